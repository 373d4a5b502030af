"""Which tensors of DeepSeek-V3 / GLM-style checkpoints are FP8-block, named as in the real files."""

from __future__ import annotations

import pytest
import torch

from kvq.checkpoint.fp8_block_layout import fp8_block_specs, is_fp8_block_weight
from kvq.checkpoint.specs import TensorSpec

FP8 = [
    "model.layers.3.self_attn.q_a_proj.weight",
    "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
    "model.layers.3.self_attn.kv_b_proj.weight",
    "model.layers.3.self_attn.indexer.wq_b.weight",
    "model.layers.3.self_attn.indexer.wk.weight",
    "model.layers.3.mlp.experts.255.down_proj.weight",
    "model.layers.3.mlp.shared_experts.up_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.78.self_attn.o_proj.weight",  # inside the MTP layer: quantized like any decoder layer
]
KEPT = [
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.norm.weight",
    "model.layers.3.input_layernorm.weight",
    "model.layers.3.self_attn.kv_a_layernorm.weight",
    "model.layers.3.self_attn.indexer.k_norm.weight",
    "model.layers.3.self_attn.indexer.weights_proj.weight",
    "model.layers.3.mlp.gate.weight",
    "model.layers.78.eh_proj.weight",
    "model.layers.78.enorm.weight",
    "model.layers.78.hnorm.weight",
    "model.layers.78.shared_head.head.weight",
    "model.layers.3.self_attn.q_proj.bias",
]


@pytest.mark.parametrize("name", FP8)
def test_linear_weights_are_fp8(name):
    assert is_fp8_block_weight(TensorSpec(name, (300, 200), torch.bfloat16))


@pytest.mark.parametrize("name", KEPT)
def test_exempt_tensors_stay_as_they_are(name):
    spec = TensorSpec(name, (300, 200) if name.endswith("weight") else (300,), torch.bfloat16)
    assert fp8_block_specs(spec) == [spec]


def test_fp8_specs_carry_a_block_scale():
    weight, scale = fp8_block_specs(TensorSpec("m.o_proj.weight", (300, 200), torch.bfloat16))
    assert weight == TensorSpec("m.o_proj.weight", (300, 200), torch.float8_e4m3fn)
    assert scale == TensorSpec("m.o_proj.weight_scale_inv", (3, 2), torch.float32)
