"""KV store: write new K/V `[T, Hkv, D]` into their page slots, quantizing to FP8 with the layer's scales.

Reference (the spec) and the torch path (over a `PagedKVCache`: K and V with one row copy when they are
the halves of one tensor, as in the engine's pool; bf16 K/V on CPU: kvq's C op, the kv's `cpu_ops.store_kv`,
the same bytes, and the checked pool's slot stamps in the same pass); the Triton kernel is in
`triton/kv_store.py`. Layout and scale conventions:
`kv_cache_layout`. Imports torch, kvq.runtime.kernels.paged and kvq.runtime.kernels.integrity.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvq.runtime.kernels.integrity.stamp_check import write_stamps
from kvq.runtime.kernels.kv_cache_layout import (
    check_new_kv,
    check_store_inputs,
    is_fp8,
    per_head_scale,
    quantize_kv,
)

if TYPE_CHECKING:
    from kvq.runtime.kernels.paged.kv_pages import PagedKVPages


def store_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """In place: `k_cache[slot // page_size, slot % page_size] = quantize(k[t])` for every slot >= 0."""
    page_size, num_kv_heads, _ = check_store_inputs(k, v, k_cache, v_cache, slot_mapping)
    is_valid = slot_mapping >= 0
    slots = slot_mapping[is_valid].long()
    pages, offsets = slots // page_size, slots % page_size
    for values, cache, scale, name in ((k, k_cache, k_scale, "k_scale"), (v, v_cache, v_scale, "v_scale")):
        scale = per_head_scale(scale, num_kv_heads, cache.device, name)
        cache[pages, offsets] = quantize_kv(values[is_valid], cache.dtype, scale[:, None])


def store_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKVPages,
    slot_mapping: torch.Tensor,
    slot_stamps: torch.Tensor | None = None,
) -> None:
    """The torch path: the reference's writes, as one `index_copy_` of K and V slot rows when the caches
    allow it (`kv.kv_rows`), else one indexed write per cache; with `slot_stamps` `[T]` and stamped
    pages (`kv.stamps`), each written slot's stamp (`write_stamps`; in the C call, the same pass)."""
    check_new_kv(k, v, slot_mapping, kv.k_cache)
    stamps = kv.stamps if slot_stamps is not None else None
    if kv.cpu_ops.store_applies(k, v, kv.k_cache, slot_mapping):  # CPU bf16: one C call, the same bytes
        kv.cpu_ops.store_kv(
            k, v, kv.k_cache, kv.v_cache, kv.stacked_scales, slot_mapping, stamps, slot_stamps
        )
        return
    if stamps is not None and slot_stamps is not None:
        write_stamps(stamps, slot_mapping, slot_stamps)
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:  # rare: drop the skipped tokens
        kept = (slot_mapping >= 0).nonzero().squeeze(1)
        k, v, slot_mapping = k[kept], v[kept], slot_mapping[kept]
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    kv_rows = kv.kv_rows
    if kv_rows is None:
        pages, offsets = slots // kv.k_cache.shape[1], slots % kv.k_cache.shape[1]
        for values, cache, scale in ((k, kv.k_cache, kv.k_scale), (v, kv.v_cache, kv.v_scale)):
            cache[pages, offsets] = quantize_kv(values, cache.dtype, scale[:, None])
        return
    stored = torch.stack([k, v])  # [2, T, Hkv, D]
    if is_fp8(kv.k_cache):  # index_copy_ has no float8 kernel on CPU: copy the bytes
        stored = quantize_kv(stored, kv.k_cache.dtype, kv.fp8_store_scale).view(torch.uint8)
        kv_rows = kv_rows.view(torch.uint8)
    elif stored.dtype != kv_rows.dtype:
        stored = stored.to(kv_rows.dtype)
    kv_rows.index_copy_(1, slots, stored.view(2, k.shape[0], kv_rows.shape[2]))
