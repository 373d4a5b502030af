"""Compiled Triton kernels on a CUDA device against their references (run by scripts/gpu_check.sh).

bf16 activations and pages as the engine uses them, sizes past one tile, and the public API's auto
dispatch. Tolerances: fraction of max |expected| (REL_TOL); fp8 stores within one e4m3 step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvq.runtime.kernels import (
    DecodeTables,
    fused_moe_reference,
    fused_moe_w4a16,
    paged_decode_attention_reference,
    prepare_w4a16,
    store_kv_reference,
    w4a16_linear,
    w4a16_reference,
)
from kvq.runtime.kernels.paged.kv_cache import PagedKVCache
from kvq.runtime.kernels.paged.latent_attention import latent_decode_attention_reference
from kvq.runtime.kernels.paged.latent_cache import PagedLatentCache
from tests.runtime.kernels.kernel_cases import (
    REL_TOL,
    assert_close_rel,
    random_paged_kv,
    random_paged_latent,
    random_selection,
    random_w4a16,
)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
BF16 = torch.bfloat16


@pytest.mark.parametrize(
    ("num_rows", "out_features", "in_features", "group_size"),
    [(1, 4096, 6144, 128), (8, 6144, 2048, 128), (33, 200, 384, 64), (300, 1000, 2048, 32), (5, 72, 256, 32)],
)
def test_w4a16_on_cuda(num_rows: int, out_features: int, in_features: int, group_size: int) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    packed, scale = random_w4a16(out_features, in_features, group_size, gen)
    x = torch.randn(num_rows, in_features, generator=gen).to(BF16)
    w = prepare_w4a16(packed.to(CUDA), scale.to(CUDA), group_size)
    assert w.backend == "triton"
    y = w4a16_linear(x.to(CUDA), w)
    assert_close_rel(y.cpu(), w4a16_reference(x, packed, scale, group_size), REL_TOL[BF16])


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(1, 16, 4), (8, 16, 4), (70, 8, 2)])
def test_fused_moe_on_cuda(num_tokens: int, num_experts: int, top_k: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    hidden, intermediate, group_size = 512, 256, 128
    w13_packed, w13_scale = random_w4a16(2 * intermediate, hidden, group_size, gen, num_experts)
    w2_packed, w2_scale = random_w4a16(hidden, intermediate, group_size, gen, num_experts)
    x = torch.randn(num_tokens, hidden, generator=gen).to(BF16)
    topk_ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    w13 = prepare_w4a16(w13_packed.to(CUDA), w13_scale.to(CUDA), group_size)
    w2 = prepare_w4a16(w2_packed.to(CUDA), w2_scale.to(CUDA), group_size)
    y = fused_moe_w4a16(x.to(CUDA), topk_ids.to(CUDA), topk_weights.to(CUDA), w13, w2)
    expected = fused_moe_reference(
        x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size
    )
    assert_close_rel(y.cpu(), expected, 3e-2)  # the w13 output is rounded to bf16 before SiLU


@pytest.mark.parametrize(
    ("seq_lens", "page_size", "queries_per_kv", "head_dim", "cache_dtype", "is_per_head"),
    [
        ([1, 15, 16, 17, 300], 16, 8, 128, torch.float8_e4m3fn, True),
        ([1, 15, 16, 17, 300], 16, 8, 128, BF16, False),
        ([3000, 5, 700], 15, 4, 64, torch.float8_e4m3fn, False),
        ([2500, 1], 32, 12, 128, BF16, True),
    ],
)
def test_paged_decode_attention_on_cuda(
    seq_lens: list[int], page_size: int, queries_per_kv: int, head_dim: int, cache_dtype: torch.dtype,
    is_per_head: bool,
) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(len(seq_lens) * head_dim)
    kv = random_paged_kv(seq_lens, page_size, 2, head_dim, cache_dtype, is_per_head, gen)
    q = torch.randn(len(seq_lens), 2 * queries_per_kv, head_dim, generator=gen).to(BF16)
    pages = (kv.k_cache, kv.v_cache, kv.k_scale, kv.v_scale)
    on_cuda = PagedKVCache.of(*(a.to(CUDA) for a in pages))
    y = on_cuda.decode_attention(q.to(CUDA), DecodeTables(kv.block_tables.to(CUDA), kv.seq_lens.to(CUDA)))
    expected = paged_decode_attention_reference(q.float(), kv.cache(), kv.tables)
    assert_close_rel(y.cpu(), expected, REL_TOL[BF16])


@pytest.mark.parametrize(
    ("cache_dtype", "is_per_head"), [(torch.float8_e4m3fn, True), (torch.float8_e4m3fn, False)]
)
def test_store_kv_fp8_on_cuda(cache_dtype: torch.dtype, is_per_head: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    num_tokens, num_kv_heads, head_dim, page_size = 37, 8, 128, 16
    k = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 3).to(BF16)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(BF16)
    slots = torch.randperm(10 * page_size, generator=gen)[:num_tokens]
    slots[::5] = -1
    k_scale = torch.rand(num_kv_heads, generator=gen) / 40 + 0.01 if is_per_head else torch.tensor(0.02)
    caches = [torch.zeros(10, page_size, num_kv_heads, head_dim, dtype=cache_dtype) for _ in range(2)]
    store_kv_reference(k, v, PagedKVCache.of(*caches, k_scale, 0.01), slots)
    on_cuda = [torch.zeros_like(c, device=CUDA) for c in caches]
    PagedKVCache.of(*on_cuda, k_scale.to(CUDA), 0.01).store(k.to(CUDA), v.to(CUDA), slots.to(CUDA))
    for actual, expected in zip(on_cuda, caches, strict=True):
        steps = (actual.cpu().view(torch.uint8).int() - expected.view(torch.uint8).int()).abs()
        assert steps.max() <= 1 and (steps > 0).float().mean() < 1e-3  # same sign: adjacent codes differ by 1


def test_store_kv_bf16_on_cuda_is_exact() -> None:
    gen = torch.Generator().manual_seed(12)
    k = torch.randn(9, 4, 64, generator=gen)  # fp32 input, rounded to bf16 pages
    slots = torch.tensor([0, 3, -1, 7, 8, 20, 21, 1, 2])
    expected = [torch.zeros(4, 8, 4, 64, dtype=BF16) for _ in range(2)]
    store_kv_reference(k, k, PagedKVCache.of(*expected), slots)
    actual = [torch.zeros_like(c, device=CUDA) for c in expected]
    PagedKVCache.of(*actual).store(k.to(CUDA), k.to(CUDA), slots.to(CUDA))
    assert all(torch.equal(a.cpu(), e) for a, e in zip(actual, expected, strict=True))


def test_store_kv_writes_slot_stamps_in_its_own_program_on_cuda() -> None:
    """A checked pool's store on CUDA: each written slot of layer 1's stamp view gets its token's stamp,
    skipped tokens none, the other layers' stamps untouched (the Triton store's HAS_STAMPS branch)."""
    k = torch.randn(9, 4, 64, generator=torch.Generator().manual_seed(13)).to(BF16)
    slots = torch.tensor([0, 3, -1, 7, 8, 20, 21, 1, 2])
    slot_stamps = torch.arange(9, dtype=torch.int64) * 1_000_003 + (7 << 40)
    table = torch.full((5, 8, 3), -9, dtype=torch.int64, device=CUDA)  # 4 pages + the zero page, 3 layers
    caches = [torch.zeros(4, 8, 4, 64, dtype=BF16, device=CUDA) for _ in range(2)]
    cache = replace(PagedKVCache.of(*caches), stamps=table.view(-1, 3)[:, 1])
    assert cache.backend == "triton"
    cache.store(k.to(CUDA), k.to(CUDA), slots.to(CUDA), slot_stamps.to(CUDA))
    flat = table.cpu().view(-1, 3)
    written = slots >= 0
    assert torch.equal(flat[slots[written], 1], slot_stamps[written])
    assert (flat[:, 0] == -9).all() and (flat[:, 2] == -9).all()
    assert int((flat[:, 1] != -9).sum()) == int(written.sum())


@pytest.mark.parametrize(
    ("seq_lens", "page_size", "num_heads", "cache_dtype", "num_selected"),
    [
        ([1, 15, 16, 17, 300], 16, 16, torch.float8_e4m3fn, None),
        ([1, 15, 16, 17, 300], 16, 16, BF16, None),
        ([3000, 5, 700], 64, 64, torch.float8_e4m3fn, None),
        ([2500, 1, 40], 32, 20, BF16, 256),  # DSA: attention over 256 selected tokens
    ],
)
def test_latent_decode_attention_on_cuda(
    seq_lens: list[int], page_size: int, num_heads: int, cache_dtype: torch.dtype, num_selected: int | None
) -> None:
    gen = torch.Generator().manual_seed(len(seq_lens) * num_heads)
    rank, rope = 512, 64  # GLM-5 / DeepSeek-V3 / Kimi K2
    pages = random_paged_latent(seq_lens, page_size, rank, rope, cache_dtype, gen, index_head_dim=128)
    q = (torch.randn(len(seq_lens), num_heads, rank + rope, generator=gen) * 0.2).to(BF16)
    indices = None if num_selected is None else random_selection(pages.seq_lens, num_selected, gen)
    cache = pages.cache
    on_cuda = PagedLatentCache.of(cache.latent_cache.to(CUDA), rank, cache.k_scale.to(CUDA))
    assert on_cuda.backend == "triton"
    tables = pages.tables._replace(token_indices=indices)
    y = on_cuda.decode_attention(
        q.to(CUDA), DecodeTables(*(a if a is None else a.to(CUDA) for a in tables)), 0.1
    )
    expected = latent_decode_attention_reference(q.float(), cache, tables, 0.1)
    assert_close_rel(y.cpu(), expected, REL_TOL[BF16])
