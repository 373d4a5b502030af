"""The INT4 and INT8 runtime copies of a dense lm_head (`lm_head_weights="int4"` / `"int8"`, and "auto": int8
for a tied lm_head on CPU): what each holds, what it computes, and that the rest of the model is untouched."""

from __future__ import annotations

import pytest
import torch

from kvq.formats.pack_quantized import quantize_pack_int4
from kvq.runtime.config import LM_HEAD_GROUP_SIZE, EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.kernels import CpuOps, w4a16_reference
from kvq.runtime.kernels.cpu.w4a8 import NativeW8A8, w4a8_path, w4a8_reference, w8a8_reference
from kvq.runtime.kernels.cpu.w8a16 import W8A16Weight, quantize_int8_rows, w8a16_reference
from kvq.runtime.kernels.w4a16 import LAYOUT_W4A8_CPU
from kvq.runtime.layers.linear import (
    INT8_DENSE_FROM_ROWS,
    DenseLinear,
    Int4Linear,
    Int8Linear,
    int8_copy,
    onednn_prepack_available,
)
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


@pytest.mark.skipif(w4a8_path() is None, reason="int4_compute w4a8 needs AVX2 and kvq's CPU extension")
def test_copies_follow_int4_compute_w4a8(tiny_checkpoint) -> None:
    """Under int4_compute "w4a8" the INT8 copy runs as W8A8 (bf16 row scales) and the INT4 copy as W4A8: the
    logits are their kernels' own results, the bytes held those of the copy."""
    path = tiny_checkpoint("llama", "bf16")
    stored = Engine(EngineConfig(model=str(path), kv_memory="4MiB"))
    dense = stored.model.lm_head.weight  # [V, H]
    vocab, hidden = dense.shape
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)

    config = EngineConfig(model=str(path), kv_memory="4MiB", lm_head_weights="int8", int4_compute="w4a8")
    w8a8 = Engine(config).model.lm_head
    assert isinstance(w8a8, Int8Linear) and isinstance(w8a8.weight, NativeW8A8)
    weight, weight_scale = quantize_int8_rows(dense, torch.bfloat16)
    assert_close_rel(w8a8.matmul(x), w8a8_reference(x, weight, weight_scale), REL_TOL[torch.bfloat16])
    held = sum(t.numel() * t.element_size() for t in w8a8.tensors())
    assert held == -(-vocab // 16) * 16 * (hidden + 2)  # a byte a weight, a bf16 scale a row (16-row tiles)

    config = EngineConfig(model=str(path), kv_memory="4MiB", lm_head_weights="int4", int4_compute="w4a8")
    w4a8 = Engine(config).model.lm_head
    assert isinstance(w4a8, Int4Linear) and w4a8.weight.layout == LAYOUT_W4A8_CPU
    weight_packed, weight_scale = quantize_pack_int4(dense, LM_HEAD_GROUP_SIZE)
    expected = w4a8_reference(x, weight_packed, weight_scale, LM_HEAD_GROUP_SIZE)
    assert_close_rel(w4a8.matmul(x), expected, REL_TOL[torch.bfloat16])


@pytest.mark.skipif(w4a8_path() is None, reason="int4_compute w4a8 needs AVX2 and kvq's CPU extension")
def test_int8_copy_is_w8a8_only_where_the_kernel_takes_k() -> None:
    gen = torch.Generator().manual_seed(1)
    for hidden, w8a8 in ((64, True), (96, True), (48, False)):  # K a multiple of 32, else W8A16
        dense = torch.randn(50, hidden, generator=gen).bfloat16()
        copy = int8_copy(dense, CpuOps.choose(), int8_activations=True)
        assert isinstance(copy.weight, NativeW8A8) == w8a8
        x = torch.randn(3, hidden, generator=gen).bfloat16()
        assert copy.matmul(x).shape == (3, 50) and copy.matmul(x[None]).shape == (1, 3, 50)
    assert isinstance(int8_copy(dense, CpuOps.choose()).weight, W8A16Weight)  # W4A16 mode: always W8A16


def test_auto_is_int8_for_a_tied_lm_head_on_cpu(smollm2, tiny_checkpoint) -> None:
    tied = Engine(EngineConfig(model=str(smollm2.bf16), kv_memory="4MiB"))  # SmolLM2 ties its lm_head
    head = tied.model.lm_head
    assert tied.config.lm_head_weights == "auto" and tied.model.lm_head_mode == "int8"
    assert isinstance(head, Int8Linear) and head.dense is not None
    assert head.dense.weight is tied.model.embed_tokens  # no second BF16 copy: the embedding's own
    hidden = head.dense.weight.shape[1]
    few = torch.randn(INT8_DENSE_FROM_ROWS - 1, hidden, generator=torch.Generator().manual_seed(1)).bfloat16()
    expected = w8a16_reference(few, head.weight.weight, head.weight.weight_scale)
    assert_close_rel(head(few), expected, REL_TOL[torch.bfloat16])  # the W8A16 copy's answer
    many = torch.randn(INT8_DENSE_FROM_ROWS, hidden, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert torch.equal(head(many), head.dense(many))  # a batch this large runs on the embedding
    # untied (the tiny llama), reference mode and an explicit choice keep the lm_head as stored
    untied = Engine(EngineConfig(model=str(tiny_checkpoint("llama", "bf16")), kv_memory="4MiB"))
    assert untied.model.lm_head_mode == "stored" and isinstance(untied.model.lm_head, DenseLinear)
    reference = Engine(EngineConfig(model=str(smollm2.bf16), kv_memory="4MiB", dtype="float32"))
    assert reference.model.lm_head_mode == "stored" and isinstance(reference.model.lm_head, DenseLinear)
    stored = Engine(EngineConfig(model=str(smollm2.bf16), kv_memory="4MiB", lm_head_weights="stored"))
    assert stored.model.lm_head_mode == "stored" and isinstance(stored.model.lm_head, DenseLinear)
