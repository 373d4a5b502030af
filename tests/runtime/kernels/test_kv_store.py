"""KV store: Triton and the torch path write the same bytes as the reference (and, in a checked pool, the
same slot stamps, Triton's in the store's own program); the reference's quantization semantics."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvq.runtime.kernels import PagedKVCache, store_kv_reference
from kvq.runtime.kernels.kv_cache_layout import kv_slot_rows

FP8 = torch.float8_e4m3fn


def _empty_caches(
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    layout: str = "separate",
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches holding sentinels (-3, -6) that must survive in untouched slots. Layout "separate":
    two tensors; "pool": the halves of one `[2, pages, page_size, Hkv, D]` (the engine's); "by_head": pages
    stored `[pages, Hkv, page_size, D]` and viewed transposed (slots are not rows)."""
    if layout == "by_head":
        pair = torch.empty(2, num_pages, num_kv_heads, page_size, head_dim, dtype=dtype).transpose(2, 3)
    else:
        pair = torch.empty(2, num_pages, page_size, num_kv_heads, head_dim, dtype=dtype)
    pair[0], pair[1] = -3.0, -6.0
    return (pair[0].clone(), pair[1].clone()) if layout == "separate" else (pair[0], pair[1])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


# (Hkv, head_dim, cache dtype, scales): non-power-of-two heads/dims exercise the masks
STORE_CASES = [
    (3, 64, FP8, "per_head"),
    (2, 80, FP8, "per_tensor"),
    (3, 64, torch.bfloat16, "per_head"),
]


def _store_inputs(
    num_kv_heads: int, head_dim: int, scales: str, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k bf16, v fp16 `[9, Hkv, D]`, slot_mapping with skips, k_scale, v_scale) for 6 pages of 5 slots."""
    slot_mapping = torch.tensor([3, -1, 7, 29, 0, -5, 12, 18, 4], dtype=torch.int64)
    k = (torch.randn(9, num_kv_heads, head_dim, generator=gen) * 4).to(torch.bfloat16)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, -0.0])  # clamp to +-448 and signed zeros
    v = torch.randn(9, num_kv_heads, head_dim, generator=gen).to(torch.float16)
    if scales == "per_head":
        k_scale = torch.rand(num_kv_heads, generator=gen) / 50 + 0.005
        v_scale = torch.rand(num_kv_heads, generator=gen) / 100 + 0.001
    else:
        k_scale, v_scale = torch.tensor([0.013]), torch.tensor(0.004)
    return k, v, slot_mapping, k_scale, v_scale


@pytest.mark.parametrize(("num_kv_heads", "head_dim", "cache_dtype", "scales"), STORE_CASES)
def test_triton_writes_the_reference_bytes(
    num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype, scales: str
) -> None:
    k, v, slot_mapping, k_scale, v_scale = _store_inputs(
        num_kv_heads, head_dim, scales, torch.Generator().manual_seed(head_dim)
    )
    expected = _empty_caches(6, 5, num_kv_heads, head_dim, cache_dtype)
    actual = tuple(c.clone() for c in expected)
    store_kv_reference(k, v, PagedKVCache.of(*expected, k_scale, v_scale), slot_mapping)
    PagedKVCache.of(*actual, k_scale, v_scale, backend="triton").store(k, v, slot_mapping)
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(_bytes(a), _bytes(e))


def test_triton_writes_the_slot_stamps_the_torch_path_writes() -> None:
    """Stamps of layer 1 of a 3-layer stamp table `[P + 1, page_size, L]`: each written slot gets its token's
    stamp, a skipped token (slot < 0) writes none, the other layers' stamps are untouched."""
    k, v, slot_mapping, k_scale, v_scale = _store_inputs(3, 64, "per_head", torch.Generator().manual_seed(5))
    slot_stamps = torch.arange(9, dtype=torch.int64) * 1_000_003 + (7 << 40)
    out = {}
    for backend in ("torch", "triton"):
        table = torch.full((7, 5, 3), -9, dtype=torch.int64)  # 6 pages + the zero page
        cache = PagedKVCache.of(*_empty_caches(6, 5, 3, 64, FP8), k_scale, v_scale, backend=backend)
        cache = replace(cache, stamps=table.view(-1, 3)[:, 1])
        cache.store(k, v, slot_mapping, slot_stamps)
        out[backend] = table, cache
    table = out["triton"][0]
    written = slot_mapping >= 0
    assert torch.equal(table.view(-1, 3)[slot_mapping[written], 1], slot_stamps[written])
    assert (table[..., 0] == -9).all() and (table[..., 2] == -9).all()
    untouched = torch.ones(35, dtype=torch.bool)
    untouched[slot_mapping[written]] = False
    assert (table.view(-1, 3)[:30][untouched[:30], 1] == -9).all()
    assert torch.equal(table[:6], out["torch"][0][:6])  # the zero page (7th) may take skipped writes
    for a, e in zip(
        (out["triton"][1].k_cache, out["triton"][1].v_cache),
        (out["torch"][1].k_cache, out["torch"][1].v_cache),
        strict=True,
    ):
        assert torch.equal(_bytes(a), _bytes(e))


@pytest.mark.parametrize("layout", ["pool", "separate", "by_head"])
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "cache_dtype", "scales"), STORE_CASES)
def test_torch_path_writes_the_reference_bytes(
    num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype, scales: str, layout: str
) -> None:
    k, v, slot_mapping, k_scale, v_scale = _store_inputs(
        num_kv_heads, head_dim, scales, torch.Generator().manual_seed(head_dim + 1)
    )
    expected = _empty_caches(6, 5, num_kv_heads, head_dim, cache_dtype)
    actual = _empty_caches(6, 5, num_kv_heads, head_dim, cache_dtype, layout)
    store_kv_reference(k, v, PagedKVCache.of(*expected, k_scale, v_scale), slot_mapping)
    assert (kv_slot_rows(*actual) is not None) == (layout == "pool")  # one row copy, else indexed writes
    PagedKVCache.of(*actual, k_scale, v_scale, backend="torch").store(k, v, slot_mapping)
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(_bytes(a), _bytes(e))


def test_fp8_store_rounds_every_e4m3_midpoint_to_even() -> None:
    # the interpreter's own fp32->fp8 cast gets these wrong; the kernel must not
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[~values.isnan()].unique()
    mids = (values[1:] + values[:-1]) / 2
    probes = torch.cat([values, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    probes = probes[: probes.numel() // 8 * 8]
    k = probes.view(-1, 1, 8)  # [T, 1, 8]
    slot_mapping = torch.arange(k.shape[0])
    caches = _empty_caches(k.shape[0], 1, 1, 8, FP8)
    PagedKVCache.of(*caches, 1.0, 1.0, backend="triton").store(k, k, slot_mapping)
    assert torch.equal(_bytes(caches[0].view(-1)), _bytes(probes.to(FP8)))


def test_reference_quantizes_with_scale_and_clamp_and_skips_negative_slots() -> None:
    k = torch.tensor([[[0.5, -1.0, 100.0, -100.0]], [[9.0, 9.0, 9.0, 9.0]]])  # [T=2, Hkv=1, D=4]
    k_cache, v_cache = _empty_caches(2, 2, 1, 4, FP8)
    store_kv_reference(
        k, k, PagedKVCache.of(k_cache, v_cache, torch.tensor(0.125), 0.5), torch.tensor([3, -1])
    )
    assert torch.equal(
        k_cache[1, 1, 0].float() * 0.125, torch.tensor([0.5, -1.0, 56.0, -56.0])
    )  # 448 * 0.125
    assert torch.equal(
        v_cache[1, 1, 0].float() * 0.5, torch.tensor([0.5, -1.0, 96.0, -96.0])
    )  # 200 ties to even 192
    assert (k_cache[:1].float() == -3.0).all() and (k_cache[1, 0].float() == -3.0).all()
