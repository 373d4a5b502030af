"""Paged decode attention: the reference against dense SDPA, and Triton and the torch path (batched, over a
step's plan) against the reference."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from kvq.runtime.kernels import PagedKVCache, paged_decode_attention_reference, plan_paged_decode
from kvq.runtime.kernels.paged.attention import paged_decode_attention_torch
from kvq.runtime.kernels.triton.paged_attention import paged_decode_attention_triton
from tests.runtime.kernels.kernel_cases import REL_TOL, PagedKV, assert_close_rel, case_id, random_paged_kv

FP8 = torch.float8_e4m3fn


class Shape(NamedTuple):
    page_size: int
    num_kv_heads: int
    queries_per_kv: int
    head_dim: int
    cache_dtype: torch.dtype
    is_per_head: bool
    dtype: torch.dtype  # q's

    def inputs(self, seq_lens: list[int], gen: torch.Generator) -> tuple[PagedKV, torch.Tensor]:
        """Random pages holding `seq_lens` tokens (`random_paged_kv`), and a query of each sequence."""
        kv = random_paged_kv(
            seq_lens,
            self.page_size,
            self.num_kv_heads,
            self.head_dim,
            self.cache_dtype,
            self.is_per_head,
            gen,
        )
        q = torch.randn(len(seq_lens), self.num_kv_heads * self.queries_per_kv, self.head_dim, generator=gen)
        return kv, q.to(self.dtype)


# (shape, num_splits)
ATTENTION_CASES = [
    (Shape(16, 2, 2, 64, FP8, True, torch.float16), None),
    (Shape(15, 2, 4, 128, FP8, False, torch.bfloat16), 3),
    (Shape(17, 1, 3, 64, torch.bfloat16, False, torch.float16), 1),
    (Shape(16, 2, 1, 128, torch.bfloat16, True, torch.bfloat16), 2),
    (Shape(8, 1, 4, 64, FP8, True, torch.float32), None),
    (Shape(1, 2, 8, 64, torch.bfloat16, False, torch.float16), 2),  # one-token pages, GQA 8
]


def _seq_lens(page_size: int) -> list[int]:
    return [page_size + 3, 1, page_size - 1, page_size, page_size + 1, 3 * page_size + 5]


@pytest.mark.parametrize("shape,num_splits", ATTENTION_CASES, ids=case_id)
def test_triton_matches_reference(shape: Shape, num_splits: int | None) -> None:
    gen = torch.Generator().manual_seed(shape.page_size * shape.head_dim)
    kv, q = shape.inputs(_seq_lens(shape.page_size), gen)
    cache = kv.cache(backend="triton")
    y = paged_decode_attention_triton(q, cache, kv.tables, sm_scale=0.3, num_splits=num_splits)
    expected = paged_decode_attention_reference(q.float(), cache, kv.tables, sm_scale=0.3)
    assert y.dtype == shape.dtype and not torch.isnan(y).any()
    assert_close_rel(y, expected, REL_TOL[shape.dtype])


# (shape, num_seqs): ATTENTION_CASES on 6 sequences, and the bf16 ones on 40: over 1024 queries x keys, bf16
# matmuls
TORCH_CASES = [(shape, 6) for shape, _ in ATTENTION_CASES] + [
    (shape, 40) for shape, _ in ATTENTION_CASES if shape.dtype == torch.bfloat16
]


@pytest.mark.parametrize("is_planned", [False, True])
@pytest.mark.parametrize("shape,num_seqs", TORCH_CASES, ids=case_id)
def test_torch_path_matches_reference(shape: Shape, num_seqs: int, is_planned: bool) -> None:
    page_size, num_kv_heads = shape.page_size, shape.num_kv_heads
    gen = torch.Generator().manual_seed(page_size * shape.head_dim + num_seqs)
    seq_lens = (_seq_lens(page_size) * 7)[:num_seqs]
    kv, q = shape.inputs(seq_lens, gen)
    cache, tables = kv.cache(), kv.tables
    if is_planned:  # the step's plan, over a bound the scheduler knows (it may exceed every length)
        max_seq_len = max(seq_lens) + 7
        plan = plan_paged_decode(kv.block_tables, kv.seq_lens, page_size, num_kv_heads, max_seq_len)
        tables = tables._replace(max_seq_len=max_seq_len, plan=plan)
    y = paged_decode_attention_torch(q, cache, tables, 0.3)
    expected = paged_decode_attention_reference(q, cache, kv.tables, 0.3)
    assert y.dtype == shape.dtype and torch.isfinite(y).all()  # the NaN in unowned slots never leaks in
    assert_close_rel(y, expected, REL_TOL[shape.dtype])


def test_torch_path_rejects_a_plan_of_another_batch() -> None:
    kv = random_paged_kv([3, 9], 8, 2, 64, torch.bfloat16, False, torch.Generator().manual_seed(4))
    plan = plan_paged_decode(kv.block_tables[:1], kv.seq_lens[:1], 8, 2, 9)
    q = torch.randn(2, 4, 64)
    cache = PagedKVCache.of(kv.k_cache, kv.v_cache)
    with pytest.raises(ValueError, match="plan has context_slots"):
        paged_decode_attention_torch(q, cache, kv.tables._replace(plan=plan))


@pytest.mark.parametrize(("cache_dtype", "is_per_head"), [(FP8, True), (FP8, False), (torch.bfloat16, False)])
def test_reference_matches_dense_sdpa(cache_dtype: torch.dtype, is_per_head: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    kv = random_paged_kv(_seq_lens(16), 16, 2, 64, cache_dtype, is_per_head, gen)
    q = torch.randn(len(kv.seq_lens), 6, 64, generator=gen)
    y = paged_decode_attention_reference(q, kv.cache(), kv.tables)
    # fp8 pages hold K/V to within half an e4m3 step (2^-4 relative); compare with a matching tolerance
    rel = 0.1 if cache_dtype == FP8 else 2e-2
    for b, (k, v) in enumerate(zip(kv.k_real, kv.v_real, strict=True)):
        dense = F.scaled_dot_product_attention(
            q[b, :, None], k.transpose(0, 1), v.transpose(0, 1), enable_gqa=True
        )
        assert_close_rel(y[b], dense[:, 0], rel)


def test_empty_sequence_gives_zeros_and_api_dispatches() -> None:
    gen = torch.Generator().manual_seed(8)
    kv = random_paged_kv([0, 5, 20], 8, 2, 64, FP8, True, gen)
    q = torch.randn(3, 4, 64, generator=gen, dtype=torch.float16)
    by_torch = kv.cache(backend="torch").decode_attention(q, kv.tables)
    by_triton = kv.cache(backend="triton").decode_attention(q, kv.tables._replace(max_seq_len=20))
    assert torch.equal(by_torch[0], torch.zeros_like(q[0])) and torch.equal(
        by_triton[0], torch.zeros_like(q[0])
    )
    assert_close_rel(by_triton, by_torch, REL_TOL[torch.float16])


def test_rejects_q_heads_not_a_multiple_of_kv_heads() -> None:
    gen = torch.Generator().manual_seed(9)
    kv = random_paged_kv([3], 8, 2, 64, torch.bfloat16, False, gen)
    q = torch.randn(1, 3, 64)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        PagedKVCache.of(kv.k_cache, kv.v_cache, backend="torch").decode_attention(q, kv.tables)
