"""Paged prefill attention against dense causal attention over the K/V its pages hold: a cached prefix, a
fresh prompt and a single token in one call; FP8 and 16-bit pages; shuffled, shared and padded page
tables with NaN in every slot no sequence owns."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvq.runtime.kernels import PagedKVCache
from kvq.runtime.kernels.kv_cache_layout import dequantize_kv, per_head_scale
from kvq.runtime.kernels.paged.prefill import paged_prefill_attention
from tests.runtime.kernels.kernel_cases import REL_TOL, assert_close_rel, random_paged_kv

FP8 = torch.float8_e4m3fn
HQ, HKV, D, PAGE = 6, 2, 64, 16
SEQ_LENS = [40, 16, 23, 1]
QUERY_LENS = [13, 16, 2, 1]  # 27 cached tokens + 13 new; a fresh prompt; 21 cached + 2; one token
# the same, with sequences of equal lengths that go through one batched call: two fresh prompts of 16
# (a prompt sampled twice), three of 40 with 27 cached, and the single tokens
GROUPED = ([40, 16, 40, 23, 1, 16, 40, 1], [13, 16, 13, 2, 1, 16, 13, 1])


def held_kv(cache: torch.Tensor, pages: torch.Tensor, seq_len: int, scale: torch.Tensor) -> torch.Tensor:
    """A sequence's K or V `[seq_len, Hkv, D]` as fp32 values, as its pages hold them (the spec's read)."""
    return dequantize_kv(cache[pages].flatten(0, 1)[:seq_len], scale)


@pytest.mark.parametrize(("seq_lens", "query_lens"), [(SEQ_LENS, QUERY_LENS), GROUPED])
@pytest.mark.parametrize(
    ("cache_dtype", "is_per_head", "q_dtype"),
    [(FP8, True, torch.bfloat16), (FP8, False, torch.float32), (torch.bfloat16, False, torch.float32)],
)
def test_prefill_is_causal_attention_over_each_sequence_context(
    cache_dtype: torch.dtype,
    is_per_head: bool,
    q_dtype: torch.dtype,
    seq_lens: list[int],
    query_lens: list[int],
) -> None:
    gen = torch.Generator().manual_seed(2)
    kv = random_paged_kv(seq_lens, PAGE, HKV, D, cache_dtype, is_per_head, gen)
    q = torch.randn(sum(query_lens), HQ, D, generator=gen).to(q_dtype)
    cache = PagedKVCache.of(kv.k_cache, kv.v_cache, kv.k_scale, kv.v_scale)
    out = paged_prefill_attention(q, cache, kv.block_tables, query_lens, seq_lens, 0.2)
    assert out.dtype == q_dtype and torch.isfinite(out).all()  # the NaN in unowned slots never leaks in
    k_scale, v_scale = (per_head_scale(s, HKV, q.device, "scale") for s in (kv.k_scale, kv.v_scale))
    start = 0
    for b, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        pages = kv.block_tables[b, : -(-seq_len // PAGE)].long()
        k, v = (
            held_kv(cache, pages, seq_len, scale).repeat_interleave(HQ // HKV, 1).transpose(0, 1)
            for cache, scale in ((kv.k_cache, k_scale), (kv.v_cache, v_scale))
        )  # [Hq, L, D]
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()[seq_len - query_len :]  # [L_q, L]
        rows = slice(start, start + query_len)
        expected = F.scaled_dot_product_attention(q[rows].float().transpose(0, 1), k, v, mask, scale=0.2)
        assert_close_rel(out[rows], expected.transpose(0, 1), REL_TOL[q_dtype])
        start += query_len


def test_a_group_larger_than_one_call_gathers_is_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal-length sequences past GROUP_CONTEXT_TOKENS of context go through several calls: the same
    values as one call."""
    gen = torch.Generator().manual_seed(4)
    seq_lens, query_lens = GROUPED
    kv = random_paged_kv(seq_lens, PAGE, HKV, D, torch.bfloat16, False, gen)
    q = torch.randn(sum(query_lens), HQ, D, generator=gen)
    cache = PagedKVCache.of(kv.k_cache, kv.v_cache)
    whole = paged_prefill_attention(q, cache, kv.block_tables, query_lens, seq_lens, 0.2)
    monkeypatch.setattr("kvq.runtime.kernels.paged.prefill.GROUP_CONTEXT_TOKENS", 50)  # 40s: one a call
    split = paged_prefill_attention(q, cache, kv.block_tables, query_lens, seq_lens, 0.2)
    assert_close_rel(split, whole, 1e-6)


def test_rejects_more_queries_than_context() -> None:
    kv = random_paged_kv([5], 8, 1, 64, torch.bfloat16, False, torch.Generator().manual_seed(3))
    cache = PagedKVCache.of(kv.k_cache, kv.v_cache)
    with pytest.raises(ValueError, match=r"every query_len must be in \[1, seq_len\]"):
        paged_prefill_attention(torch.randn(6, 2, 64), cache, kv.block_tables, [6], [5])
