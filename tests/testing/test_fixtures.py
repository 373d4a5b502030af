"""Tiny BF16 / FP8-block fixtures: load in transformers, dequantize to the BF16 model, HF layout."""

from __future__ import annotations

import json
import re

import pytest
import torch
from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvq.checkpoint.reader import Checkpoint
from kvq.errors import KvqError
from kvq.formats.fp8_block import FP8_E4M3_MAX, dequantize_fp8_block
from kvq.testing.checkpoint_fixtures import build_fixture
from kvq.testing.tiny_models import ARCHITECTURES, build_model

MOE_ARCHITECTURES = ("glm4_moe", "glm_moe_dsa", "deepseek_v3")
E4M3_HALF_STEP = 2.0**-4  # 3 mantissa bits: rounding error <= 1/16 of the value (normal range)
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # in units of the block scale
# Independent of kvq's layout code: what DeepSeek-V3 / GLM FP8 checkpoints leave unquantized.
NOT_FP8 = [r"re:.*embed_tokens$", r"re:.*lm_head$", r"re:.*norm$", r"re:.*mlp\.gate$", r"re:.*weights_proj$"]


def _read_all(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    return ckpt.read_many(ckpt.tensors)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_bf16_fixture_loads_in_transformers_and_generates(arch, tiny_checkpoint):
    root = tiny_checkpoint(arch, "bf16")
    model, info = AutoModelForCausalLM.from_pretrained(root, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and info["error_msgs"] == []
    expected = build_model(model.config, seed=0).state_dict()
    loaded = model.state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name].float(), tensor.float()), name

    tokenizer = AutoTokenizer.from_pretrained(root)
    assert len(tokenizer) == model.config.vocab_size
    chat = [{"role": "user", "content": "Why did the fire spread towards the town?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits.float()  # [1, S, V]
    assert torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 0.1  # not constant along the vocab at any position
    assert logits.argmax(-1).unique().numel() > 1  # positions do not all predict one token
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 6)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_fp8_fixture_dequantizes_to_the_bf16_fixture(arch, tiny_checkpoint):
    bf16 = _read_all(Checkpoint.open(tiny_checkpoint(arch, "bf16")))
    fp8 = _read_all(Checkpoint.open(tiny_checkpoint(arch, "fp8-block")))
    oracle = FP8BlockDequantizer(ignore=NOT_FP8, dtype=torch.float32).validate(dict(fp8))
    assert oracle.keys() == bf16.keys()

    num_fp8 = 0
    for name, reference in bf16.items():
        if fp8[name].dtype != torch.float8_e4m3fn:
            assert fp8[name].dtype == reference.dtype and torch.equal(fp8[name], reference), name
            continue
        num_fp8 += 1
        scale = fp8[f"{name}_scale_inv"]
        ours = dequantize_fp8_block(fp8[name], scale)
        assert torch.equal(ours, oracle[name]), name
        _assert_within_fp8_error(name, ours, reference.float(), scale)
    assert num_fp8 > 0


def _assert_within_fp8_error(name: str, deq: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> None:
    rows, cols = ref.shape
    full_scale = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    err = (deq - ref).abs()
    bound = E4M3_HALF_STEP * ref.abs() + E4M3_SUBNORMAL_HALF_STEP * full_scale
    # slack: the subtraction deq - ref cancels most fp32 digits (a few ulps of a weight ~1e-6 of err)
    assert (err <= bound * (1 + 1e-4)).all(), f"{name}: FP8 error above the e4m3 step"
    # per 128x128 block: the largest error is at most half the top binade's step (amax / 28)
    for i in range(0, rows, 128):
        for j in range(0, cols, 128):
            block_amax = ref[i : i + 128, j : j + 128].abs().max()
            assert err[i : i + 128, j : j + 128].max() <= block_amax * 16 / FP8_E4M3_MAX * (1 + 1e-4), name
    assert err.max() > 0, f"{name}: FP8 weight equals BF16 exactly; the fixture was not quantized"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_fp8_fixture_layout_matches_deepseek_v3(arch, tiny_checkpoint):
    root = tiny_checkpoint(arch, "fp8-block")
    ckpt = Checkpoint.open(root)
    infos = ckpt.tensors
    assert ckpt.format == "fp8-block"
    assert ckpt.quantization_config == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    fp8_weights = [n for n, i in infos.items() if i.dtype == "F8_E4M3"]
    for name in fp8_weights:
        rows, cols = infos[name].shape
        scale = infos[f"{name.removesuffix('.weight')}.weight_scale_inv"]
        assert scale.dtype == "F32" and scale.shape == (-(-rows // 128), -(-cols // 128))
    assert any(infos[n].shape[1] % 128 for n in fp8_weights), "no partial FP8 block along the input dim"
    assert sum(infos[n].shape[1] % 128 == 0 for n in fp8_weights) > len(fp8_weights) / 2
    kept = {n: i.dtype for n, i in infos.items() if i.dtype not in ("F8_E4M3",) and "scale_inv" not in n}
    for name, dtype in kept.items():
        expected = "F32" if name.endswith("e_score_correction_bias") else "BF16"
        assert dtype == expected, name
        assert re.search(r"embed_tokens|lm_head|norm|mlp\.gate\.|weights_proj|\.bias$", name), name
    if arch == "glm_moe_dsa":
        assert infos["model.layers.1.self_attn.indexer.weights_proj.weight"].dtype == "BF16"
        assert infos["model.layers.1.self_attn.indexer.wq_b.weight"].dtype == "F8_E4M3"


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_fixture_is_sharded_like_a_real_checkpoint(arch, fmt, tiny_checkpoint):
    root = tiny_checkpoint(arch, fmt)
    ckpt = Checkpoint.open(root)
    assert ckpt.format == fmt
    assert len(ckpt.shards) >= 3
    index = json.loads((root / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == ckpt.tensor_bytes
    weight_map = index["weight_map"]
    if fmt == "fp8-block":
        scales = [n for n in weight_map if n.endswith("_scale_inv")]
        crossing = [n for n in scales if weight_map[n] != weight_map[n.removesuffix("_scale_inv")]]
        assert crossing, "no weight_scale_inv stored in another shard than its weight"
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (root / name).is_file(), name
    config = json.loads((root / "config.json").read_text())
    tokenizer_config = json.loads((root / "tokenizer_config.json").read_text())
    assert config["vocab_size"] == len(AutoTokenizer.from_pretrained(root))
    assert tokenizer_config["eos_token"] == "<|im_end|>" and "chat_template" in tokenizer_config


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_moe_experts_are_stored_per_expert_2d(arch, tiny_checkpoint):
    infos = Checkpoint.open(tiny_checkpoint(arch, "bf16")).tensors
    assert not [n for n in infos if n.endswith(("gate_up_proj", "experts.down_proj"))]
    layer = {n.removeprefix("model.layers.1.") for n in infos if n.startswith("model.layers.1.mlp.")}
    for e in range(8):
        for proj, shape in (("gate", (128, 256)), ("up", (128, 256)), ("down", (256, 128))):
            assert infos[f"model.layers.1.mlp.experts.{e}.{proj}_proj.weight"].shape == shape
    assert {
        "mlp.gate.weight",
        "mlp.gate.e_score_correction_bias",
        "mlp.shared_experts.gate_proj.weight",
        "mlp.shared_experts.up_proj.weight",
        "mlp.shared_experts.down_proj.weight",
    } <= layer
    assert len(layer) == 8 * 3 + 5
    assert infos["model.layers.0.mlp.down_proj.weight"].shape == (256, 576)  # dense first layer


def test_build_fixture_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "keep.txt").write_text("user data")
    with pytest.raises(KvqError, match="not an empty directory"):
        build_fixture("llama", "bf16", tmp_path / "model")
    assert (tmp_path / "model" / "keep.txt").read_text() == "user data"


def test_build_fixture_rejects_unknown_names(tmp_path):
    with pytest.raises(KvqError, match="pick one of"):
        build_fixture("mixtral", "bf16", tmp_path / "a")
    with pytest.raises(KvqError, match="pick one of"):
        build_fixture("llama", "int4", tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
