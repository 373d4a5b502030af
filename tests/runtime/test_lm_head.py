"""The opt-in INT4 runtime copy of a dense lm_head (`lm_head_weights="int4"`): what it holds, what it
computes, and that the rest of the model is untouched."""

from __future__ import annotations

import torch

from kvq.formats.pack_quantized import quantize_pack_int4
from kvq.runtime.config import LM_HEAD_GROUP_SIZE, EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.kernels import w4a16_reference
from kvq.runtime.layers.linear import DenseLinear, Int4Linear
from tests.runtime.kernels.kernel_cases import REL_TOL, assert_close_rel


def test_int4_lm_head_is_the_quantized_dense_one(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama", "bf16")  # an untied, BF16 lm_head
    stored = Engine(EngineConfig(model=str(path), kv_memory="4MiB"))
    quantized = Engine(EngineConfig(model=str(path), kv_memory="4MiB", lm_head_weights="int4"))
    assert isinstance(stored.model.lm_head, DenseLinear) and isinstance(quantized.model.lm_head, Int4Linear)
    dense = stored.model.lm_head.weight  # [V, H]
    vocab, hidden = dense.shape
    weight_packed, weight_scale = quantize_pack_int4(dense, LM_HEAD_GROUP_SIZE)
    w = quantized.model.lm_head.weight
    assert w.group_size == LM_HEAD_GROUP_SIZE and (w.out_features, w.in_features) == (vocab, hidden)
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    logits = quantized.model.compute_logits(x)
    assert logits.dtype == torch.float32
    expected = w4a16_reference(x, weight_packed, weight_scale, LM_HEAD_GROUP_SIZE)
    assert_close_rel(logits, expected, REL_TOL[torch.bfloat16])
    # the copy replaces the dense lm_head: a quarter of its bytes plus the group scales
    saved = dense.numel() * 2 - (dense.numel() // 2 + weight_scale.numel() * 2)
    assert stored.weight_bytes - quantized.weight_bytes == saved
    layers = zip(stored.model.layers[0].tensors(), quantized.model.layers[0].tensors(), strict=True)
    assert all(torch.equal(a, b) for a, b in layers)
