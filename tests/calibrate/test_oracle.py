"""Layer-streamed scales equal those of llm-compressor oneshot and of a plain transformers forward.

Same token samples on every side (4 windows of 64 tokens of the bundled Wikipedia text). "To bf16
rounding": compared with a relative tolerance of one bf16 ulp (2^-8). Against the transformers cache the
forward runs in bf16 (the serving dtype) and scales are identical. Against oneshot both sides run in fp32:
llm-compressor swaps transformers' fused MoE experts for per-expert Linear modules, whose different bf16
summation order moves a MoE model's activations by bf16 noise (one glm4_moe head differed by 1.2% in bf16).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvq.calibrate.calibrate_checkpoint import load_tokenizer, measure_kv
from kvq.calibrate.observed_kv import ObservedKV, layer_tensor_names, observed_kv
from kvq.calibrate.observers import KvRecorder
from kvq.calibrate.samples import build_samples
from kvq.calibrate.scales import layer_scales
from kvq.checkpoint.model_config import text_model
from kvq.checkpoint.reader import Checkpoint
from kvq.data.texts import load_texts
from kvq.fixtures.kimi_fixture import kimi_oracle_model
from tests.calibrate.references import cache_amax, dense_copy, model_cache_amax, oneshot_scales
from tests.conftest import TinyCheckpoint

BF16_ULP = 2.0**-8


def sample_ids(model_dir: Path, num_samples: int = 4, seq_len: int = 64) -> torch.Tensor:
    return build_samples(
        load_texts(None, "calibration"),
        load_tokenizer(model_dir),
        num_samples=num_samples,
        seq_len=seq_len,
        seed=0,
        source="test",
    ).input_ids


def streamed(
    model_dir: Path, input_ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> tuple[ObservedKV, KvRecorder]:
    ckpt = Checkpoint.open(model_dir)
    model = text_model(ckpt.config, "config.json")
    layout = observed_kv(model.fields, model.at)
    lm = ckpt.under(model.weight_prefix)
    names = layer_tensor_names(lm, layout.num_layers)
    return layout, measure_kv(lm, model, layout, names, input_ids, dtype)


def all_scales(
    layout: ObservedKV, strategy: str, amax: dict[int, dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i in range(layout.num_layers):
        out |= layer_scales(layout, strategy, i, amax[i])
    return out


def assert_same_scales(mine: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert sorted(mine) == sorted(reference)
    for name, scale in mine.items():
        assert scale.dtype == torch.bfloat16
        expected = reference[name].flatten().to(torch.bfloat16).float()
        torch.testing.assert_close(scale.flatten().float(), expected, rtol=BF16_ULP, atol=0, msg=name)


@pytest.mark.parametrize("arch", ["llama", "glm4_moe"])
@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_gqa_scales_match_oneshot_and_transformers_cache(
    tiny_checkpoint: TinyCheckpoint, arch: str, strategy: str
) -> None:
    model_dir = tiny_checkpoint(arch, "bf16")
    ids = sample_ids(model_dir)
    layout, recorder = streamed(model_dir, ids)
    mine = all_scales(layout, strategy, recorder.amax)
    assert_same_scales(mine, all_scales(layout, strategy, cache_amax(model_dir, ids, layout)))
    _, recorder_fp32 = streamed(model_dir, ids, torch.float32)
    assert_same_scales(
        all_scales(layout, strategy, recorder_fp32.amax),
        oneshot_scales(model_dir, ids, strategy, torch.float32),
    )
    if strategy == "attn_head":
        assert mine["model.layers.0.self_attn.k_scale"].shape == (layout.num_kv_heads, 1, 1)
    else:
        assert mine["model.layers.0.self_attn.k_scale"].shape == (1,)


def test_running_max_covers_every_sample(tiny_checkpoint: TinyCheckpoint) -> None:
    """The scale covers the largest sample, not the last one (llm-compressor's default minmax pitfall)."""
    model_dir = tiny_checkpoint("llama", "bf16")
    ids = sample_ids(model_dir, num_samples=6)
    _, together = streamed(model_dir, ids)
    per_sample = [streamed(model_dir, ids[i : i + 1])[1] for i in range(len(ids))]
    last_is_smaller = []
    for layer, observed in together.amax.items():
        for name, amax in observed.items():
            expected = torch.stack([r.amax[layer][name] for r in per_sample]).amax(dim=0)
            assert torch.equal(amax, expected)
            last_is_smaller.append(bool((per_sample[-1].amax[layer][name] < amax).any()))
    assert any(last_is_smaller)  # else this test could not tell a running max from a last-batch max


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v3"])
def test_mla_latent_matches_transformers_cache(tiny_checkpoint: TinyCheckpoint, arch: str) -> None:
    """glm_moe_dsa / deepseek_v3 (YaRN, interleaved RoPE), unpatched: kv_c and k_pe maxima equal the
    hooked/cached ones of a whole-model forward."""
    model_dir = tiny_checkpoint(arch, "bf16")
    ids = sample_ids(model_dir)
    layout, recorder = streamed(model_dir, ids)
    assert layout.is_mla and layout.observed == ("kv_c", "k_pe")
    reference = cache_amax(model_dir, ids, layout)
    for i in range(layout.num_layers):
        for name in layout.observed:
            assert torch.equal(recorder.amax[i][name], reference[i][name]), (i, name)
    scales = all_scales(layout, "tensor", recorder.amax)
    latent = torch.maximum(recorder.amax[0]["kv_c"], recorder.amax[0]["k_pe"])
    assert scales["model.layers.0.self_attn.k_scale"].item() == (latent / 448).bfloat16().item()
    assert torch.equal(scales["model.layers.0.self_attn.k_scale"], scales["model.layers.0.self_attn.v_scale"])


@pytest.mark.parametrize("producer, arch", [("kvq compress", "glm_moe_dsa"), ("model_free_ptq", "glm4_moe")])
def test_int4_checkpoint_matches_forward_of_its_dequantized_weights(
    int4_by: Callable[[str, str], Path], tmp_path: Path, producer: str, arch: str
) -> None:
    """On an INT4 checkpoint, streaming equals a whole-model forward of the same (dequantized) weights."""
    model_dir = int4_by(producer, arch)
    assert Checkpoint.open(model_dir).format in ("pack-quantized", "mixed")
    ids = sample_ids(model_dir)
    layout, recorder = streamed(model_dir, ids)
    reference = cache_amax(dense_copy(model_dir, tmp_path / "dense"), ids, layout)
    assert_same_scales(all_scales(layout, "tensor", recorder.amax), all_scales(layout, "tensor", reference))


def test_kimi_native_int4_latent_matches_its_deepseek_v3_oracle(tiny_checkpoint: TinyCheckpoint) -> None:
    """Kimi K2.6's layout (kimi_k25 text_config, language_model. prefix, INT4 group-32 experts): streaming
    its language model equals a forward of the DeepSeek-V3 oracle on the dequantized weights."""
    model_dir = tiny_checkpoint("deepseek_v3", "kimi-int4")
    ids = sample_ids(model_dir)
    layout, recorder = streamed(model_dir, ids)
    assert layout.is_mla and layout.num_layers == 3
    reference = model_cache_amax(kimi_oracle_model(model_dir, torch.bfloat16), ids, layout)
    assert_same_scales(all_scales(layout, "tensor", recorder.amax), all_scales(layout, "tensor", reference))


def test_fp8_block_scales_close_to_bf16_twin(tiny_checkpoint: TinyCheckpoint) -> None:
    """The FP8-block fixture holds the BF16 weights up to FP8 rounding: its scales are within a few %."""
    ids = sample_ids(tiny_checkpoint("glm4_moe", "bf16"))
    layout, bf16 = streamed(tiny_checkpoint("glm4_moe", "bf16"), ids)
    _, fp8 = streamed(tiny_checkpoint("glm4_moe", "fp8-block"), ids)
    mine, twin = all_scales(layout, "tensor", fp8.amax), all_scales(layout, "tensor", bf16.amax)
    for name in mine:
        torch.testing.assert_close(mine[name].float(), twin[name].float(), rtol=0.05, atol=0, msg=name)
