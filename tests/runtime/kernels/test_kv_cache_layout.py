"""What the torch paths share from the KV cache layout: K and V as one slot-row view only when they are the
halves of one tensor (the FP8 bit move is tested in tests/formats/test_fp8_e4m3.py)."""

from __future__ import annotations

import torch

from kvq.runtime.kernels.kv_cache_layout import kv_slot_rows

FP8 = torch.float8_e4m3fn


def test_kv_slot_rows_views_the_halves_of_one_tensor() -> None:
    storage = torch.zeros(3, 2, 5, 4, 2, 8, dtype=FP8)  # [L, 2, pages, page_size, Hkv, D], the pool's
    k_cache, v_cache = storage[1]
    rows = kv_slot_rows(k_cache, v_cache)
    assert rows is not None and rows.shape == (2, 20, 16)
    rows.view(torch.uint8)[1, 6] = 7  # V of slot 6: page 1, offset 2
    assert (storage[1, 1, 1, 2].view(torch.uint8) == 7).all()
    assert int(storage.view(torch.uint8).count_nonzero()) == 16  # nothing else was touched


def test_kv_slot_rows_refuses_other_layouts() -> None:
    pool = torch.zeros(2, 5, 4, 2, 8, dtype=torch.bfloat16)
    assert kv_slot_rows(pool[1], pool[0]) is None  # V before K
    assert kv_slot_rows(pool[0], pool[0]) is None  # one tensor as both
    assert kv_slot_rows(pool[0], torch.zeros_like(pool[1])) is None  # two allocations
    by_head = torch.zeros(2, 5, 2, 4, 8, dtype=torch.bfloat16).transpose(2, 3)  # [2, pages, page, Hkv, D]
    assert kv_slot_rows(by_head[0], by_head[1]) is None  # slots are not rows
