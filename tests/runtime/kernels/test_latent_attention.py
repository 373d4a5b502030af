"""MLA latent decode attention and store: the reference against the un-absorbed MLA math (dense SDPA over
K/V expanded by kv_b_proj), Triton (interpreted) and the torch path against the reference on irregular
shapes, strided slots (index keys beside the latent), page tables with holes and shared pages, NaN in
unowned slots, FP8 and 16-bit pages, DSA selections; the store writes the reference's bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvq.runtime.kernels.paged.attention import plan_paged_decode
from kvq.runtime.kernels.paged.latent_attention import (
    latent_decode_attention_reference,
    latent_decode_attention_torch,
)
from kvq.runtime.kernels.paged.latent_cache import PagedLatentCache, store_latent_reference
from kvq.runtime.kernels.triton.latent_attention import latent_decode_attention_triton
from kvq.runtime.kv_layout import LatentLayout
from tests.runtime.kernels.kernel_cases import (
    REL_TOL,
    assert_close_rel,
    random_paged_latent,
    random_selection,
)

FP8 = torch.float8_e4m3fn
# (page_size, heads, kv_lora_rank, rope, cache dtype, q dtype, index_head_dim (strided slots), num_splits)
CASES = [
    (16, 4, 128, 64, FP8, torch.float16, 0, None),
    (15, 5, 72, 24, torch.bfloat16, torch.float32, 40, 3),
    (8, 20, 64, 32, FP8, torch.float32, 16, 1),  # two head blocks
    (1, 3, 48, 16, torch.bfloat16, torch.bfloat16, 0, 2),  # one-token pages
]


def _seq_lens(page_size: int) -> list[int]:
    return [page_size + 3, 1, page_size - 1, page_size, 3 * page_size + 5, 0]


def _inputs(case: tuple, gen: torch.Generator, num_seqs: int | None = None):
    page_size, heads, rank, rope, cache_dtype, q_dtype, index_dim, _ = case
    seq_lens = (_seq_lens(page_size) * 7)[: num_seqs or 6]
    pages = random_paged_latent(seq_lens, page_size, rank, rope, cache_dtype, gen, index_dim)
    q = (torch.randn(len(seq_lens), heads, rank + rope, generator=gen) * 0.5).to(q_dtype)
    return pages, q


def _reference(q: torch.Tensor, pages, token_indices: torch.Tensor | None = None) -> torch.Tensor:
    return latent_decode_attention_reference(
        q.float(), pages.cache, pages.tables._replace(token_indices=token_indices), 0.3
    )


@pytest.mark.parametrize("case", CASES)
def test_triton_matches_reference(case: tuple) -> None:
    gen = torch.Generator().manual_seed(case[0] * case[2])
    pages, q = _inputs(case, gen)
    cache = PagedLatentCache.of(pages.cache.latent_cache, case[2], pages.cache.k_scale, backend="triton")
    y = latent_decode_attention_triton(q, cache, pages.tables, 0.3, num_splits=case[-1])
    assert y.dtype == q.dtype and torch.isfinite(y).all()
    assert_close_rel(y, _reference(q, pages), REL_TOL[q.dtype])
    assert torch.equal(y[-1], torch.zeros_like(y[-1]))  # the empty sequence


@pytest.mark.parametrize("case", CASES)
def test_triton_sparse_matches_reference(case: tuple) -> None:
    gen = torch.Generator().manual_seed(case[0] * case[2] + 1)
    pages, q = _inputs(case, gen)
    indices = random_selection(pages.seq_lens, 2 * case[0] - 1, gen)
    cache = PagedLatentCache.of(pages.cache.latent_cache, case[2], pages.cache.k_scale, backend="triton")
    tables = pages.tables._replace(token_indices=indices)
    y = latent_decode_attention_triton(q, cache, tables, 0.3, num_splits=case[-1])
    assert_close_rel(y, _reference(q, pages, indices), REL_TOL[q.dtype])


@pytest.mark.parametrize("mode", ["plain", "planned", "sparse"])
@pytest.mark.parametrize("num_seqs", [6, 40])  # 40: past the small-attention bound, bf16 matmuls
@pytest.mark.parametrize("case", CASES)
def test_torch_path_matches_reference(case: tuple, num_seqs: int, mode: str) -> None:
    gen = torch.Generator().manual_seed(case[0] * case[2] + num_seqs)
    pages, q = _inputs(case, gen, num_seqs)
    tables, indices = pages.tables, None
    if mode == "planned":  # the step's plan over a bound the scheduler knows, one KV head
        bound = int(pages.seq_lens.max()) + 7
        plan = plan_paged_decode(pages.block_tables, pages.seq_lens, case[0], 1, bound)
        tables = tables._replace(max_seq_len=bound, plan=plan)
    elif mode == "sparse":
        indices = random_selection(pages.seq_lens, 5, gen)
        tables = tables._replace(token_indices=indices)
    y = latent_decode_attention_torch(q, pages.cache, tables, 0.3)
    assert y.dtype == q.dtype and torch.isfinite(y).all()  # the NaN in unowned slots never leaks in
    assert_close_rel(y, _reference(q, pages, indices), REL_TOL[q.dtype])


def test_absorbed_reference_is_mla_attention() -> None:
    """softmax(q_nope W_UK . kv_c + q_pe . k_pe) kv_c W_UV == attention over K = [kv_c W_UK^T, k_pe],
    V = kv_c W_UV^T (transformers' form)."""
    gen = torch.Generator().manual_seed(3)
    heads, rank, rope, nope, v_dim = 3, 32, 16, 24, 20
    pages = random_paged_latent([13], 4, rank, rope, torch.float32, gen)
    w_uk = torch.randn(heads, nope, rank, generator=gen) / rank**0.5
    w_uv = torch.randn(heads, v_dim, rank, generator=gen) / rank**0.5
    q_nope, q_pe = torch.randn(1, heads, nope, generator=gen), torch.randn(1, heads, rope, generator=gen)
    q = torch.cat([torch.einsum("bhn,hnr->bhr", q_nope, w_uk), q_pe], dim=-1)
    out = torch.einsum("bhr,hvr->bhv", _reference(q, pages), w_uv)
    kv_c, k_pe = pages.rows[0].split([rank, rope], dim=-1)  # [L, R], [L, rope]
    k = torch.cat([torch.einsum("lr,hnr->hln", kv_c, w_uk), k_pe.expand(heads, -1, -1)], dim=-1)
    v = torch.einsum("lr,hvr->hlv", kv_c, w_uv)
    expected = F.scaled_dot_product_attention(torch.cat([q_nope, q_pe], -1).transpose(0, 1), k, v, scale=0.3)
    assert_close_rel(out[0], expected[:, 0], 1e-5)


@pytest.mark.parametrize(("cache_dtype", "index_dim"), [(FP8, 16), (torch.bfloat16, 0), (torch.float32, 8)])
def test_torch_store_writes_the_reference_bytes(cache_dtype: torch.dtype, index_dim: int) -> None:
    gen = torch.Generator().manual_seed(5)
    rank, rope, page_size = 40, 24, 5
    layout = LatentLayout(
        rank, rope, cache_dtype, index_dim, torch.float32 if index_dim == 8 else torch.bfloat16
    )
    storage = layout.allocate(1, 6, page_size, torch.device("cpu"))
    storage.fill_(0x5A)  # sentinels that must survive in untouched slots
    latent, index_keys = layout.views(storage[0])
    expected = latent.clone()
    slot_mapping = torch.tensor([3, -1, 7, 29, 0, -5, 12], dtype=torch.int64)
    kv_c = (torch.randn(7, rank, generator=gen) * 4).to(torch.bfloat16)
    kv_c[0, :4] = torch.tensor([1e4, -1e4, 0.0, -0.0])  # clamp to +-448 and signed zeros
    k_pe = torch.randn(7, rope, generator=gen).to(torch.bfloat16)
    index_k = torch.randn(7, index_dim, generator=gen) if index_dim else None
    store_latent_reference(expected, kv_c, k_pe, slot_mapping, 0.013)
    cache = PagedLatentCache.of(latent, rank, torch.tensor([0.013]), index_keys)
    cache.store(kv_c, k_pe, slot_mapping, index_k)
    assert torch.equal(latent.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))
    if index_keys is not None and index_k is not None:
        kept = slot_mapping >= 0
        stored = index_keys.flatten(0, 1)[slot_mapping[kept]]
        assert torch.equal(stored, index_k[kept].to(index_keys.dtype))
        untouched = torch.ones(6 * page_size, dtype=torch.bool)
        untouched[slot_mapping[kept]] = False
        assert (index_keys.flatten(0, 1)[untouched].contiguous().view(torch.uint8) == 0x5A).all()


def test_rejects_queries_of_another_width() -> None:
    pages = random_paged_latent([3], 4, 32, 16, torch.bfloat16, torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match=r"expected \[B, H, 48\]"):
        latent_decode_attention_torch(torch.randn(1, 2, 40), pages.cache, pages.tables, 0.3)
