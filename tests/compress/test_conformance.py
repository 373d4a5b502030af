"""kvq's output against the oracles: llm-compressor model_free_ptq (same packed weights and scales, and the
same BF16 for FP8-block weights kvq writes as BF16), the source (everything else not quantized is carried
over unchanged), and compressed-tensors' own decompressors.

model_free_ptq dequantizes every FP8-block weight it does not quantize to BF16 (FP8BlockDequantizer);
kvq's `vllm` target keeps those FP8 except the ones no engine runs (a partial input block, or a fused
layer with partial output blocks), and its `sglang` target writes them all as BF16: for both targets,
every BF16 weight kvq dequantized is byte-identical to model_free_ptq's."""

from __future__ import annotations

import json

import pytest
import torch

from kvq.checkpoint.dense import read_dense
from kvq.checkpoint.reader import Checkpoint
from tests.compress.oracle import library_decompress, load_all

# (arch, fmt, recipe, group_size): every fixture, with a recipe that quantizes something in it.
CASES = [
    ("llama", "fp8-block", "w4a16-linear", None),
    ("llama", "bf16", "w4a16-linear", None),
    ("glm4_moe", "fp8-block", "w4a16-experts", None),
    ("glm4_moe", "bf16", "w4a16-experts", None),
    ("glm_moe_dsa", "fp8-block", "w4a16-experts", None),
    ("glm_moe_dsa", "bf16", "w4a16-experts", None),
    ("deepseek_v3", "fp8-block", "w4a16-experts", None),
    ("deepseek_v3", "bf16", "w4a16-experts", None),
    ("glm_moe_dsa", "fp8-block", "w4a16-linear", 64),
]


@pytest.mark.slow
@pytest.mark.parametrize("target", ["vllm", "sglang"])
@pytest.mark.parametrize(("arch", "fmt", "recipe", "group_size"), CASES)
def test_packed_weights_match_model_free_ptq(compressed, model_free, arch, fmt, recipe, group_size, target):
    out = compressed(arch, fmt, recipe, group_size, target)
    ours = load_all(out)
    theirs = load_all(model_free(arch, fmt, recipe, group_size))
    packed = sorted(n for n in ours if n.endswith(".weight_packed") and n in theirs)
    assert len(packed) >= 6
    for name in packed:
        module = name.removesuffix(".weight_packed")
        for param in ("weight_packed", "weight_scale", "weight_shape"):
            assert torch.equal(ours[f"{module}.{param}"], theirs[f"{module}.{param}"]), f"{module}.{param}"
    # Both quantize the same set, except Linears whose in_features the group does not divide: model_free
    # cannot quantize those either (it raises), so kvq keeps them and lists them.
    assert packed == sorted(n for n in theirs if n.endswith(".weight_packed"))
    dequantized = [
        d["name"] for d in json.loads((out / "kvq_manifest.json").read_text())["fp8_dequantized_to_bf16"]
    ]
    if recipe == "w4a16-experts":  # the FP8 fixtures' dense MLP (576) and q_lora (192) are partial blocks
        assert bool(dequantized) == (fmt == "fp8-block")
    for name in dequantized:
        assert ours[name].dtype == torch.bfloat16 and torch.equal(ours[name], theirs[name]), name
    if target == "sglang":  # nothing FP8 is left: every kept FP8 weight is BF16, as model_free_ptq writes
        assert not any(t.dtype == torch.float8_e4m3fn for t in ours.values())


@pytest.mark.parametrize(("arch", "fmt", "recipe", "group_size"), CASES[:6])
def test_everything_else_is_carried_over_unchanged(
    compressed, tiny_checkpoint, arch, fmt, recipe, group_size
):
    source = load_all(tiny_checkpoint(arch, fmt))
    ours = load_all(compressed(arch, fmt, recipe, group_size))
    for name, tensor in ours.items():
        module, _, param = name.rpartition(".")
        if param in ("weight_packed", "weight_scale", "weight_shape") and f"{module}.weight_packed" in ours:
            assert f"{module}.weight" in source
        elif param == "weight_scale":  # FP8 kept: the block scale is the source weight_scale_inv
            assert torch.equal(tensor, source[f"{module}.weight_scale_inv"])
        elif source[name].dtype == torch.float8_e4m3fn and tensor.dtype == torch.bfloat16:
            assert f"{name}_scale_inv" in source  # written as BF16: compared with model_free_ptq above
        else:
            assert torch.equal(tensor.view(torch.uint8), source[name].view(torch.uint8)), name
    dropped = {n for n in source if n.endswith(".weight_scale_inv")} | {
        n for n in source if n.removesuffix(".weight") + ".weight_packed" in ours
    }
    assert set(source) - set(ours) == dropped


@pytest.mark.parametrize(("arch", "fmt", "recipe", "group_size"), CASES)
def test_compressed_tensors_decompresses_to_kvqs_dequantization(compressed, arch, fmt, recipe, group_size):
    from compressed_tensors.quantization import QuantizationConfig

    out = compressed(arch, fmt, recipe, group_size)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k != "version"}).config_groups
    tensors, ckpt = load_all(out), Checkpoint.open(out)
    int4 = [n.removesuffix(".weight_packed") for n in tensors if n.endswith(".weight_packed")]
    fp8 = [n.removesuffix(".weight") for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    assert bool(fp8) == ("group_1" in groups)
    assert int4 and (fmt == "bf16" or recipe == "w4a16-linear" or fp8)
    for module in int4:
        ours = read_dense(ckpt, module + ".", torch.bfloat16)[module + ".weight"]
        assert torch.equal(library_decompress(tensors, module, groups["group_0"]).bfloat16(), ours), module
    for module in fp8:
        ours = read_dense(ckpt, module + ".", torch.float32)[module + ".weight"]
        assert torch.equal(library_decompress(tensors, module, groups["group_1"]).float(), ours), module
