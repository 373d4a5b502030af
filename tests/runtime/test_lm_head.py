"""The opt-in INT4 and INT8 runtime copies of a dense lm_head (`lm_head_weights="int4"` / `"int8"`): what
each holds, what it computes, and that the rest of the model is untouched."""

from __future__ import annotations

import torch

from kvq.formats.pack_quantized import quantize_pack_int4
from kvq.runtime.config import LM_HEAD_GROUP_SIZE, EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.kernels import w4a16_reference
from kvq.runtime.kernels.w8a16 import quantize_int8_rows, w8a16_reference
from kvq.runtime.layers.linear import DenseLinear, Int4Linear, Int8Linear, onednn_prepack_available
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
    assert logits.dtype == torch.bfloat16  # the lm_head's dtype: the sampler reads bf16 logits as they are
    expected = w4a16_reference(x, weight_packed, weight_scale, LM_HEAD_GROUP_SIZE)
    assert_close_rel(logits, expected, REL_TOL[torch.bfloat16])
    # the copy replaces the dense lm_head: a quarter of its bytes plus the group scales
    saved = dense.numel() * 2 - (dense.numel() // 2 + weight_scale.numel() * 2)
    assert stored.weight_bytes - quantized.weight_bytes == saved
    layers = zip(stored.model.layers[0].tensors(), quantized.model.layers[0].tensors(), strict=True)
    assert all(torch.equal(a, b) for a, b in layers)


def test_int8_lm_head_is_the_quantized_dense_one(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama", "bf16")
    stored = Engine(EngineConfig(model=str(path), kv_memory="4MiB"))
    quantized = Engine(EngineConfig(model=str(path), kv_memory="4MiB", lm_head_weights="int8"))
    assert isinstance(stored.model.lm_head, DenseLinear) and isinstance(quantized.model.lm_head, Int8Linear)
    loaded_bytes = stored.weight_bytes, quantized.weight_bytes  # at load (a batch adds a blocked copy, below)
    dense = stored.model.lm_head.weight  # [V, H]
    vocab, hidden = dense.shape
    weight, weight_scale = quantize_int8_rows(dense)
    w = quantized.model.lm_head.weight
    assert torch.equal(w.weight, weight) and torch.equal(w.weight_scale, weight_scale)
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    logits = quantized.model.compute_logits(x)
    assert logits.dtype == torch.bfloat16  # the lm_head's dtype: the sampler reads bf16 logits as they are
    assert_close_rel(logits, w8a16_reference(x, weight, weight_scale), REL_TOL[torch.bfloat16])
    # closer to the dense lm_head than the INT4 copy is
    dense_logits = stored.model.compute_logits(x).float()
    int4 = Engine(EngineConfig(model=str(path), kv_memory="4MiB", lm_head_weights="int4"))
    err8 = (logits.float() - dense_logits).abs().max()
    assert err8 < (int4.model.compute_logits(x).float() - dense_logits).abs().max()
    # the copy replaces the dense lm_head: half its bytes plus a fp32 scale per row
    assert loaded_bytes[0] - loaded_bytes[1] == dense.numel() * 2 - (dense.numel() + vocab * 4)
    # the batch of 5 above made the dense lm_head's oneDNN copy, which is resident and counted (where
    # oneDNN has a bf16 path: not on AVX2-only CPUs, where batches take F.linear and nothing is added; nor
    # where the CPU path is amx: decode batches read the weight itself, `dense_amx_matmul`)
    packed = stored.model.lm_head.packed
    if stored.model.lm_head.is_amx:
        assert packed is None and stored.weight_bytes == loaded_bytes[0]
    elif onednn_prepack_available():
        assert packed is not None
        assert stored.weight_bytes == loaded_bytes[0] + packed.numel() * packed.element_size()
    else:
        assert packed is None and stored.weight_bytes == loaded_bytes[0]
    layers = zip(stored.model.layers[0].tensors(), quantized.model.layers[0].tensors(), strict=True)
    assert all(torch.equal(a, b) for a, b in layers)
