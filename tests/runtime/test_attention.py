"""The engine's torch attention path (CPU) against the kernels' references, which are its spec: batched
decode over paged BF16/FP8 K/V with NaN in unowned slots, the K/V store, the FP8 bit-move to bf16, and
prefill over cached prefix pages."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvq.runtime.batch import ForwardBatch
from kvq.runtime.kernels import paged_decode_attention_reference, store_kv_reference
from kvq.runtime.kernels.kv_cache_layout import per_head_scale
from kvq.runtime.layers.attention import PagedAttention, fp8_bits_to, fp8_factor
from kvq.runtime.model_runner import ModelRunner
from tests.runtime.kernels.kernel_cases import REL_TOL, assert_close_rel, random_paged_kv

HQ, HKV, D, PAGE = 6, 2, 64, 16


def bound_layer(k_cache: torch.Tensor, v_cache: torch.Tensor, kv) -> PagedAttention:
    """A layer over the pool layout `[2, pages, page_size, Hkv, D]` holding these K and V pages."""
    layer = PagedAttention(HQ, HKV, D)
    cpu = torch.device("cpu")
    layer.bind(
        torch.stack([k_cache, v_cache]),
        per_head_scale(kv.k_scale, HKV, cpu, "k"),
        per_head_scale(kv.v_scale, HKV, cpu, "v"),
    )
    return layer


def with_zero_page(cache: torch.Tensor) -> torch.Tensor:
    """The pool layout: one all-zero page after the pages handed out."""
    return torch.cat([cache, torch.zeros_like(cache[:1])])


def decode_batch(block_tables: torch.Tensor, seq_lens: list[int], zero_page: int) -> ForwardBatch:
    """What `ModelRunner.prepare` builds for a decode step (block-table padding -1)."""
    runner = ModelRunner(None, PAGE, zero_page, torch.device("cpu"))  # type: ignore[arg-type]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    slots, is_valid = runner._context_slots(block_tables, lens, max(seq_lens))
    bias = (
        torch.zeros(is_valid.shape).masked_fill(~is_valid, float("-inf")).repeat_interleave(HKV, 0)[:, None]
    )
    empty = torch.empty(0)
    return ForwardBatch(
        False,
        empty,
        empty,
        empty,
        block_tables,
        slots,
        lens,
        seq_lens,
        max(seq_lens),
        [1] * len(seq_lens),
        torch.arange(len(seq_lens)),
        bias,
    )


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("is_per_head", [False, True])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_batched_decode_matches_the_kernel_reference(
    cache_dtype: torch.dtype, is_per_head: bool, q_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(0)
    seq_lens = [37, 16, 1, 70, 9]
    kv = random_paged_kv(seq_lens, PAGE, HKV, D, cache_dtype, is_per_head, gen)
    block_tables = kv.block_tables.clone()
    block_tables[block_tables >= kv.k_cache.shape[0]] = -1  # the engine pads with -1
    q = torch.randn(len(seq_lens), HQ, D, generator=gen).to(q_dtype)
    layer = bound_layer(with_zero_page(kv.k_cache), with_zero_page(kv.v_cache), kv)
    found = layer._decode_torch(q, decode_batch(block_tables, seq_lens, zero_page=kv.k_cache.shape[0]))
    expected = paged_decode_attention_reference(
        q, kv.k_cache, kv.v_cache, block_tables, kv.seq_lens, kv.k_scale, kv.v_scale, D**-0.5
    )
    assert torch.isfinite(found).all()  # the NaN in unowned slots never leaks in
    assert_close_rel(found, expected, REL_TOL[q_dtype])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_store_matches_the_kernel_reference(cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    kv = random_paged_kv([20, 5], PAGE, HKV, D, cache_dtype, True, gen)
    layer = bound_layer(kv.k_cache, kv.v_cache, kv)
    k, v = (torch.randn(7, HKV, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    slots = torch.tensor([3, 40, 41, 17, 0, 63, 22])
    expected_k, expected_v = kv.k_cache.clone(), kv.v_cache.clone()
    store_kv_reference(k, v, expected_k, expected_v, slots, kv.k_scale, kv.v_scale)
    layer._store_torch(k, v, slots)
    for found, expected in ((layer.k_cache, expected_k), (layer.v_cache, expected_v)):
        assert torch.equal(found.view(torch.uint8), expected.view(torch.uint8))  # bit for bit, NaN included


def test_fp8_bit_move_is_exact() -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[torch.isfinite(codes.float())]  # 254 finite codes, subnormals included
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(fp8_bits_to(codes, dtype).float() * 2.0**120, codes.float()), dtype
    for scale in (1.0, 0.0371, 3.5e-4):  # value * 2^-120 * (scale * 2^120) rounds once, like fp8 * scale
        found = fp8_bits_to(codes, torch.float32) * fp8_factor(torch.tensor(scale))
        assert torch.equal(found, codes.float() * scale), scale


def test_prefill_over_cached_prefix_pages_is_causal_attention() -> None:
    gen = torch.Generator().manual_seed(2)
    context, new = 40, 13  # the first 27 tokens are cached pages, 13 are computed now
    k_all, v_all = (torch.randn(context, HKV, D, generator=gen) for _ in range(2))
    q = torch.randn(new, HQ, D, generator=gen)
    k_cache = torch.full((6, PAGE, HKV, D), float("nan"))
    v_cache = k_cache.clone()
    pages = torch.tensor([4, 0, 2], dtype=torch.int32)
    for i, page in enumerate(pages.tolist()):
        n = min(PAGE, context - i * PAGE)
        k_cache[page, :n], v_cache[page, :n] = k_all[i * PAGE : i * PAGE + n], v_all[i * PAGE : i * PAGE + n]
    layer = PagedAttention(HQ, HKV, D)
    layer.bind(torch.stack([k_cache, v_cache]), torch.ones(HKV), torch.ones(HKV))
    slots = (pages.long()[:, None] * PAGE + torch.arange(PAGE)).flatten()[:context]
    empty = torch.empty(0)
    batch = ForwardBatch(
        True,
        empty,
        empty,
        empty,
        pages[None],
        slots[None],
        torch.tensor([context], dtype=torch.int32),
        [context],
        context,
        [new],
        torch.tensor([new - 1]),
    )
    found = layer._prefill(q, batch)
    mask = torch.ones(context, context, dtype=torch.bool).tril()[-new:]  # [new, context]
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k_all.repeat_interleave(3, 1).transpose(0, 1),
        v_all.repeat_interleave(3, 1).transpose(0, 1),
        attn_mask=mask,
    )
    assert_close_rel(found, expected.transpose(0, 1), REL_TOL[torch.float32])
