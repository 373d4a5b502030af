"""Loader: weights stay in their stored form (resident bytes ~ checkpoint bytes), every missing, unexpected
or mis-shaped tensor is reported at once by name, unknown architectures and missing KV scales."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvq.checkpoint.reader import Checkpoint
from kvq.errors import KvqError
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.layers.linear import DenseLinear, Fp8Linear, Int4Linear
from kvq.runtime.layers.moe import Int4Experts
from kvq.runtime.sampling import SamplingParams
from tests.runtime.kv_scales import with_kv_scales


def single_file_copy(source: Path, out: Path) -> Path:
    """`source` rewritten as one `model.safetensors` (so tests can edit its tensors freely)."""
    ckpt = Checkpoint.open(source)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file(ckpt.read_many(ckpt.tensors), str(out / "model.safetensors"))
    return out


def edit_tensors(path: Path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block", "int4"])
@pytest.mark.parametrize("arch", ["llama", "glm4_moe"])
def test_resident_weights_are_the_stored_bytes(tiny_checkpoint, int4_checkpoint, arch: str, fmt: str) -> None:
    path = int4_checkpoint(arch) if fmt == "int4" else tiny_checkpoint(arch, fmt)
    engine = Engine(EngineConfig(model=str(path), kv_memory="1MiB"))
    assert abs(engine.weight_bytes / engine.ckpt.tensor_bytes - 1) < 0.10
    linears = [
        layer.mlp.down_proj if arch == "llama" else layer.self_attn.o_proj for layer in engine.model.layers
    ]
    kind = {"bf16": DenseLinear, "fp8-block": Fp8Linear, "int4": Int4Linear}[fmt]
    if arch == "glm4_moe" and fmt == "int4":  # w4a16-experts: INT4 experts, attention kept FP8-block
        assert isinstance(engine.model.layers[-1].mlp.experts, Int4Experts)
        kind = Fp8Linear
    assert all(isinstance(linear, kind) for linear in linears)


def test_fp8_weights_can_be_kept_as_bf16(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama", "fp8-block")
    per_use = Engine(EngineConfig(model=str(path), kv_memory="1MiB"))
    widened = Engine(EngineConfig(model=str(path), kv_memory="1MiB", fp8_weights="bf16"))
    assert widened.weight_bytes > 1.3 * per_use.weight_bytes
    prompt = [[5, 6, 7, 8]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert per_use.generate(prompt, params)[0].token_ids == widened.generate(prompt, params)[0].token_ids


def test_missing_unexpected_and_misshaped_tensors_are_reported_at_once(
    tiny_checkpoint, tmp_path: Path
) -> None:
    path = single_file_copy(tiny_checkpoint("glm4_moe", "bf16"), tmp_path / "model")

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["model.layers.0.self_attn.q_proj.weight"]
        del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
        tensors["model.layers.1.mlp.surprise.weight"] = torch.zeros(2)
        tensors["model.norm.weight"] = torch.ones(7, dtype=torch.bfloat16)

    edit_tensors(path, edit)
    with pytest.raises(KvqError) as info:
        Engine(EngineConfig(model=str(path), kv_memory="1MiB"))
    message = str(info.value)
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.2.mlp.experts.5.up_proj.weight",
        "model.layers.1.mlp.surprise.weight",
        "model.norm.weight has shape (7,), expected (256,)",
    ):
        assert name in message
    assert "2 tensor(s) missing" in message and "1 tensor(s) unexpected" in message


def test_int4_with_zero_points_is_refused_by_name(int4_checkpoint, tmp_path: Path) -> None:
    path = single_file_copy(int4_checkpoint("llama"), tmp_path / "model")
    edit_tensors(path, lambda t: t.update({"model.layers.0.mlp.down_proj.weight_zero_point": torch.zeros(1)}))
    with pytest.raises(KvqError, match=r"unexpected: model\.layers\.0\.mlp\.down_proj\.weight_zero_point"):
        Engine(EngineConfig(model=str(path), kv_memory="1MiB"))


def test_unknown_architecture_lists_the_supported_ones(tiny_checkpoint, tmp_path: Path) -> None:
    path = Path(shutil.copytree(tiny_checkpoint("llama", "bf16"), tmp_path / "model"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "qwen3"}))
    expected = (
        r"model_type 'qwen3': kvq does not implement .*supported: llama, glm4_moe, glm_moe_dsa, deepseek_v3"
    )
    with pytest.raises(KvqError, match=expected):
        Engine(EngineConfig(model=str(path), kv_memory="1MiB"))


def test_unsupported_quant_method(tiny_checkpoint, tmp_path: Path) -> None:
    path = shutil.copytree(tiny_checkpoint("llama", "bf16"), tmp_path / "model")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(KvqError, match="quant_method 'gptq' is not supported"):
        Engine(EngineConfig(model=str(path), kv_memory="1MiB"))


def test_fp8_pages_without_scales_warn_or_fail(tiny_checkpoint, caplog: pytest.LogCaptureFixture) -> None:
    path = str(tiny_checkpoint("llama", "bf16"))
    with caplog.at_level(logging.WARNING, logger="kvq"):
        engine = Engine(EngineConfig(model=path, kv_cache_dtype="fp8_e4m3", kv_memory="1MiB"))
    assert "no k_scale/v_scale for 2 of 2 layers" in caplog.text and "scale 1.0" in caplog.text
    assert engine.model.layers[0].self_attn.attn.k_scale.tolist() == [1.0, 1.0]
    with pytest.raises(KvqError, match="run `kvq calibrate`"):
        Engine(EngineConfig(model=path, kv_cache_dtype="fp8_e4m3", kv_memory="1MiB", require_kv_scales=True))


def test_checkpoint_scales_reach_the_fp8_pages(tiny_checkpoint, tmp_path: Path) -> None:
    scales = {
        f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor([0.01 * (i + 1)], dtype=torch.bfloat16)
        for i in range(2)
        for kv in ("k", "v")
    }
    path = with_kv_scales(tiny_checkpoint("llama", "bf16"), tmp_path / "model", scales)
    engine = Engine(EngineConfig(model=str(path), kv_memory="1MiB", require_kv_scales=True))
    assert engine.kv_pool.dtype == torch.float8_e4m3fn  # auto: the checkpoint has a kv_cache_scheme
    k_scale = engine.model.layers[1].self_attn.attn.k_scale
    assert torch.allclose(k_scale, torch.tensor([0.02, 0.02]), rtol=1e-2)


@pytest.mark.parametrize(
    ("fmt", "name", "element"),
    [
        ("bf16", "model.layers.1.post_attention_layernorm.weight", 3),  # a norm: a tensor compress keeps
        ("fp8-block", "model.layers.0.self_attn.q_proj.weight", 70),  # FP8 e4m3's NaN (no infinities)
    ],
)
def test_a_nan_in_any_tensor_read_is_refused_by_name(
    tiny_checkpoint, tmp_path: Path, fmt, name, element
) -> None:
    path = single_file_copy(tiny_checkpoint("llama", fmt), tmp_path / "model")

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        t = tensors[name]
        bits = t.view(torch.uint8) if t.element_size() == 1 else None
        if bits is not None:
            bits.view(-1)[element] = 0x7F
        else:
            t.view(-1)[element] = float("inf")

    edit_tensors(path, edit)
    with pytest.raises(KvqError, match=rf"tensor {name} holds a NaN or an infinity \(element {element}\)"):
        Engine(EngineConfig(model=str(path), kv_memory="1MiB"))
