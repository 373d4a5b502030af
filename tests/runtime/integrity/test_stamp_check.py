"""Slot stamps (`kernels.integrity.stamp_check`): the C check equals the torch reference on irregular shapes
and random faults; every store (the torch path, the C store, the MLA latent store) writes each new token's
stamp with its K/V, and skips it where the slot mapping skips the token; only a checked pool holds stamps,
counted in its page bytes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvq.runtime.kernels.cpu import ops as cpu_ops
from kvq.runtime.kernels.integrity.cpu_calls import stamps_check_applies
from kvq.runtime.kernels.integrity.stamp_check import (
    check_stamps,
    check_stamps_reference,
    stamp_of,
    write_stamps,
)
from kvq.runtime.kernels.paged.kv_cache import PagedKVCache
from kvq.runtime.kernels.paged.latent_cache import PagedLatentCache
from kvq.runtime.kv_layout import GqaLayout, LatentLayout, slot_bytes
from kvq.runtime.kv_pool import STAMP_BYTES, KVPool, page_bytes


def stamped_pool(
    num_pages: int, page_size: int, num_layers: int, rows: int, width: int, seed: int, is_full: bool = False
):
    """Stamps `[P + 1, page_size, L]` written as `rows` requests of distinct pages would (`is_full`: every
    slot of their tables), and their block tables, writers and token counts."""
    gen = torch.Generator().manual_seed(seed)
    stamps = torch.zeros(num_pages + 1, page_size, num_layers, dtype=torch.int64)
    pages = torch.randperm(num_pages, generator=gen)[: rows * width].view(rows, width)
    writers = torch.randint(1, 1 << 62, (rows, width), generator=gen) * (1 - 2 * (torch.arange(width) % 2))
    lens = torch.randint(0, width * page_size + 1, (rows,), generator=gen)
    if is_full:
        lens[:] = width * page_size
    for b in range(rows):
        for p in range(int(lens[b])):
            stamps[pages[b, p // page_size], p % page_size] = int(writers[b, p // page_size]) ^ p
    return stamps, pages.to(torch.int32), writers, lens


@pytest.mark.parametrize(
    ("page_size", "num_layers", "rows", "width"), [(4, 3, 5, 7), (16, 30, 9, 3), (3, 1, 1, 1)]
)
def test_check_stamps_c_equals_reference_and_finds_each_fault(page_size, num_layers, rows, width) -> None:
    stamps, tables, writers, lens = stamped_pool(rows * width + 3, page_size, num_layers, rows, width, 0)
    good = check_stamps_reference(stamps, tables, writers, lens)
    assert good.tolist() == [-1] * rows
    assert check_stamps(stamps, tables, writers, lens).tolist() == good.tolist()
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        b = int(torch.randint(rows, (1,), generator=gen))
        if int(lens[b]) == 0:
            continue
        p = int(torch.randint(int(lens[b]), (1,), generator=gen))
        layer = int(torch.randint(num_layers, (1,), generator=gen))
        bad = stamps.clone()
        page = int(tables[b, p // page_size])
        bad[page, p % page_size, layer] ^= 1 << int(torch.randint(64, (1,), generator=gen))  # any bit
        expected = check_stamps_reference(bad, tables, writers, lens)
        assert int(expected[b]) == p
        assert check_stamps(bad, tables, writers, lens).tolist() == expected.tolist()
    skipped = writers.clone()
    skipped[:, 0] = 0  # a page written in this very step: not checked
    stamps[:, :, :] = 0
    first = check_stamps_reference(stamps, tables, skipped, lens)
    expected = [-1 if n <= page_size else page_size for n in lens.tolist()]
    assert first.tolist() == expected == check_stamps(stamps, tables, skipped, lens).tolist()


def test_check_stamps_flags_reads_past_the_table_and_outside_the_pool() -> None:
    stamps, tables, writers, lens = stamped_pool(10, 4, 2, 2, 2, 3, is_full=True)
    lens[:] = 9  # past two pages of 4
    assert check_stamps_reference(stamps, tables, writers, lens).tolist() == [8, 8]
    assert check_stamps(stamps, tables, writers, lens).tolist() == [8, 8]
    lens[:] = 1
    tables[1, 0] = 99
    assert check_stamps_reference(stamps, tables, writers, lens).tolist() == [-1, 0]
    assert check_stamps(stamps, tables, writers, lens).tolist() == [-1, 0]


@pytest.mark.skipif(cpu_ops._ext is None, reason="the C ops are not built")
def test_the_c_check_applies_to_the_pool_and_batch_tensors() -> None:
    stamps, tables, writers, lens = stamped_pool(10, 4, 2, 2, 2, 3)
    assert stamps_check_applies(stamps, tables, writers, lens)


def test_write_stamps_skips_negative_slots() -> None:
    stamps = torch.zeros(12, 3, dtype=torch.int64)  # [slots, L]
    column = stamps[:, 1]
    write_stamps(column, torch.tensor([5, -1, 2]), torch.tensor([50, 60, 20]))
    assert stamps[:, 1].tolist()[:-1] == [0, 0, 20, 0, 0, 50] + [0] * 5  # the last slot takes skips
    assert stamps[:, 0].abs().sum() == stamps[:, 2].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_every_gqa_store_writes_the_stamps_with_the_kv(dtype: torch.dtype) -> None:
    layout = GqaLayout(num_kv_heads=3, head_dim=20, dtype=dtype)
    pool = KVPool(layout, num_layers=2, num_pages=5, page_size=4, device=torch.device("cpu"), is_checked=True)
    caches = pool.layer_caches([{"k_scale": None, "v_scale": None}] * 2, require_kv_scales=False, where="t")
    assert pool.stamps is not None
    slots = torch.tensor([3, 9, -1, 17])
    stamp_values = stamp_of(torch.tensor([7, 7, 7, -8]) << 40, torch.tensor([3, 5, 6, 1]))
    k = torch.randn(4, 3, 20).to(torch.bfloat16 if dtype != torch.float32 else dtype)
    for layer, cache in enumerate(caches):
        assert isinstance(cache, PagedKVCache)
        cache.store(k, k, slots, stamp_values)
        flat = pool.stamps.view(-1, 2)[:, layer]
        assert flat[[3, 9, 17]].tolist() == stamp_values[[0, 1, 3]].tolist()
    before = pool.stamps.clone()
    caches[0].store(k, k, slots)  # no stamps given (--kv-integrity off): none written
    assert torch.equal(pool.stamps, before)


def test_the_latent_store_writes_the_stamps_with_the_rows() -> None:
    layout = LatentLayout(kv_lora_rank=16, rope_dim=8, dtype=torch.float8_e4m3fn, index_head_dim=8)
    pool = KVPool(layout, num_layers=3, num_pages=4, page_size=4, device=torch.device("cpu"), is_checked=True)
    caches = pool.layer_caches([{"k_scale": torch.tensor(0.5)}] * 3, require_kv_scales=True, where="t")
    assert pool.stamps is not None
    slots = torch.tensor([2, -1, 13])
    stamp_values = torch.tensor([11, 12, 13])
    for layer, cache in enumerate(caches):
        assert isinstance(cache, PagedLatentCache)
        cache.store(torch.randn(3, 16), torch.randn(3, 8), slots, torch.randn(3, 8), stamp_values)
        assert pool.stamps.view(-1, 3)[[2, 13], layer].tolist() == [11, 13]


@pytest.mark.parametrize(
    "layout", [GqaLayout(3, 20, torch.bfloat16), LatentLayout(16, 8, torch.float8_e4m3fn, 8)]
)
def test_an_unchecked_pool_holds_no_stamp_and_its_stores_write_none(layout) -> None:
    """--kv-integrity off: no stamp byte, and a store given slot stamps (a batch made checked) skips them;
    a switch to a checked mode gives the pool zeroed stamps and its bound layers new caches carrying them."""
    pool = KVPool(layout, num_layers=2, num_pages=3, page_size=4, device=torch.device("cpu"))
    scales = [{"k_scale": torch.tensor(0.5), "v_scale": None}] * 2
    caches = pool.layer_caches(scales, require_kv_scales=False, where="t")
    assert pool.stamps is None and all(c.stamps is None for c in caches)
    assert pool.nbytes == page_bytes(layout, 2, 4) * 4 == 2 * 4 * 4 * slot_bytes(layout)
    rows = (torch.randn(2, 3, 20), torch.randn(2, 3, 20)) if isinstance(layout, GqaLayout) else None
    latent = (torch.randn(2, 16), torch.randn(2, 8), torch.tensor([1, 6]), torch.randn(2, 8))
    for cache in caches:
        if rows is not None:
            cache.store(*rows, torch.tensor([1, 6]), torch.tensor([5, 7]))
        else:
            cache.store(*latent, torch.tensor([5, 7]))
    layers = [SimpleNamespace(bind_kv=lambda kv, i=i: bound.__setitem__(i, kv)) for i in range(2)]
    bound: dict[int, object] = {}
    pool.bind(layers)
    assert [bound[i] for i in range(2)] == caches
    pool.set_checked(True)
    assert pool.stamps is not None and pool.stamps.abs().sum() == 0
    assert pool.nbytes == page_bytes(layout, 2, 4, is_checked=True) * 4
    assert [bound[i] for i in range(2)] == pool.caches and all(c.stamps is not None for c in pool.caches)
    pool.set_checked(False)
    assert pool.stamps is None and all(bound[i].stamps is None for i in range(2))  # type: ignore[attr-defined]


def test_the_plans_kvq_bytes_per_token_are_the_pools(tiny_checkpoint) -> None:
    """`kvq plan`'s bytes per token for kvq's own pool equal the pool's measured bytes, GQA and MLA, in each
    mode: with the checked pool's slot stamps, and without them (the server figure, `total`) with off."""
    from kvq.checkpoint.kv_cache_spec import kv_cache_bytes
    from kvq.drill.workload import drill_engine

    for arch in ("llama", "glm_moe_dsa"):
        for mode in ("off", "tags"):
            engine = drill_engine(tiny_checkpoint(arch, "bf16"), mode)
            pool = engine.kv_pool
            planned = kv_cache_bytes(engine.kv_spec, "fp32")
            slots = pool.page_size * (pool.num_pages + 1)
            assert pool.nbytes == planned.kvq_total(mode != "off") * slots, (arch, mode)
            assert pool.is_checked == (mode != "off") and planned.kvq_total(False) == planned.total
        assert planned.kvq_total(True) - planned.total == STAMP_BYTES * pool.num_layers


@pytest.mark.parametrize("is_checked", [False, True])
def test_page_bytes_count_the_stamps_of_a_checked_pool(is_checked: bool) -> None:
    layout = GqaLayout(num_kv_heads=3, head_dim=64, dtype=torch.float8_e4m3fn)
    pool = KVPool(
        layout, num_layers=30, num_pages=7, page_size=16, device=torch.device("cpu"), is_checked=is_checked
    )
    assert pool.nbytes == page_bytes(layout, 30, 16, is_checked) * (pool.num_pages + 1)
    assert page_bytes(layout, 30, 16, is_checked) == 30 * 16 * (
        2 * 3 * 64 + (STAMP_BYTES if is_checked else 0)
    )


def test_bad_stamp_check_inputs_are_named() -> None:
    stamps, tables = torch.zeros(3, 4, 2, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int32)
    writers, lens = torch.ones(2, 1, dtype=torch.int64), torch.ones(2, dtype=torch.int64)
    with pytest.raises(
        TypeError, match=r"must be int64 and block_tables integer; got read_lens torch.float32"
    ):
        check_stamps_reference(stamps, tables, writers, lens.float())
    with pytest.raises(ValueError, match=r"expected_writers has shape \(2, 2\), expected \(2, 1\)"):
        check_stamps_reference(stamps, tables, writers.repeat(1, 2), lens)
