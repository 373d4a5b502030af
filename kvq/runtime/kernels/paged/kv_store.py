"""KV store: write new K/V `[T, Hkv, D]` into their page slots, quantizing to FP8 with the layer's scales.

The reference (the spec). The torch path is `PagedKVCache.store` itself (`paged/kv_cache.py`), which
launches the Triton kernel (`triton/kv_store.py`) for Triton pages. Layout and scale conventions:
`kv_cache_layout`. Imports torch and kvq.runtime.kernels.paged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvq.runtime.kernels.kv_cache_layout import check_new_kv, quantize_kv

if TYPE_CHECKING:
    from kvq.runtime.kernels.paged.kv_pages import PagedKVPages


def store_kv_reference(
    k: torch.Tensor, v: torch.Tensor, kv: PagedKVPages, slot_mapping: torch.Tensor
) -> None:
    """In place: `k_cache[slot // page_size, slot % page_size] = quantize(k[t])` for every slot >= 0."""
    check_new_kv(k, v, slot_mapping, kv.k_cache)
    page_size = kv.k_cache.shape[1]
    is_valid = slot_mapping >= 0
    slots = slot_mapping[is_valid].long()
    pages, offsets = slots // page_size, slots % page_size
    for values, cache, scale in ((k, kv.k_cache, kv.k_scale), (v, kv.v_cache, kv.v_scale)):
        cache[pages, offsets] = quantize_kv(values[is_valid], cache.dtype, scale[:, None])
