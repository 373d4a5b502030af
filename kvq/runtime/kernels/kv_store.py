"""KV store: write new K/V `[T, Hkv, D]` into their page slots, quantizing to FP8 with the layer's scales.

Reference (the spec, also the torch path); the Triton kernel is in `kv_store_triton.py`.
Layout and scale conventions: `kv_cache_layout`. Imports torch only.
"""

from __future__ import annotations

import torch

from kvq.runtime.kernels.kv_cache_layout import check_kv_cache, per_head_scale, quantize_kv


def check_store_inputs(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> tuple[int, int, int]:
    """(page_size, num_kv_heads, head_dim) after checking shapes, dtypes, devices (ValueError/TypeError)."""
    page_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    expected = (slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1, num_kv_heads, head_dim)
    if slot_mapping.dim() != 1 or tuple(k.shape) != expected or tuple(v.shape) != expected:
        raise ValueError(
            f"k {tuple(k.shape)}, v {tuple(v.shape)} and slot_mapping {tuple(slot_mapping.shape)} must be "
            f"[T, {num_kv_heads}, {head_dim}], [T, {num_kv_heads}, {head_dim}] and [T]"
        )
    if slot_mapping.is_floating_point() or not k.is_floating_point() or not v.is_floating_point():
        raise TypeError(
            f"slot_mapping must be integer and k, v float, got {slot_mapping.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (k.device == v.device == slot_mapping.device == k_cache.device):
        raise ValueError(
            f"k, v, slot_mapping and the caches must share a device, got {k.device}, {v.device}, "
            f"{slot_mapping.device}, {k_cache.device}"
        )
    return page_size, num_kv_heads, head_dim


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
        cache[pages, offsets] = quantize_kv(values[is_valid], cache.dtype, scale)
