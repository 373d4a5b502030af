"""kvq's output against the oracles: llm-compressor model_free_ptq (same packed weights and scales), the
source (everything not quantized is carried over unchanged), and compressed-tensors' own decompressors."""

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
@pytest.mark.parametrize(("arch", "fmt", "recipe", "group_size"), CASES)
def test_packed_weights_match_model_free_ptq(compressed, model_free, arch, fmt, recipe, group_size):
    ours = load_all(compressed(arch, fmt, recipe, group_size))
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
