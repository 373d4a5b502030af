"""The paged KV cache contract shared by the KV store and decode attention (`PagedKVCache`), and its checks.

Per layer: `k_cache`, `v_cache` `[num_pages, page_size, num_kv_heads, head_dim]`, bfloat16 or
float8_e4m3fn (fp16/fp32 work too), innermost dim contiguous. `k_scale`/`v_scale`: fp32 per tensor
(a scalar or `[1]`) or per head (`[num_kv_heads]`; `[num_kv_heads, 1, 1]` is accepted); None means 1.
FP8 pages store clamp(k / k_scale, +-448) cast to fp8 and read fp8.float() * k_scale; other pages
ignore the scales. `block_tables` int32 `[B, max_pages]` (only the first ceil(seq_len / page_size)
entries are read; padding may be -1 or anything), `seq_lens` int32 `[B]`, `slot_mapping` int64 `[T]`
= page * page_size + offset, negative = skip. Also what the torch paths share: K and V as one view of
slot rows (FP8 pages are read by `kvq.formats.fp8_e4m3.fp8_bits_to`). Imports torch and kvq.formats.
"""

from __future__ import annotations

import math

import torch

from kvq.formats.fp8_e4m3 import FP8_E4M3_MAX

KV_CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


def is_fp8(cache: torch.Tensor) -> bool:
    """True for float8_e4m3fn pages (the only dtype that uses k_scale/v_scale)."""
    return cache.dtype == torch.float8_e4m3fn


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """(page_size, num_kv_heads, head_dim) of a valid K/V cache pair, else ValueError/TypeError."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
            "[num_pages, page_size, num_kv_heads, head_dim]"
        )
    if k_cache.dtype not in KV_CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise TypeError(
            f"KV cache dtypes must match and be one of {KV_CACHE_DTYPES}, got {k_cache.dtype}, "
            f"{v_cache.dtype}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous in head_dim (stride 1)")
    if k_cache.device != v_cache.device:
        raise ValueError(f"k_cache is on {k_cache.device} but v_cache on {v_cache.device}")
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    return page_size, num_kv_heads, head_dim


def per_head_scale(
    scale: torch.Tensor | float | None, num_kv_heads: int, device: torch.device, name: str
) -> torch.Tensor:
    """A per-tensor or per-head KV scale as fp32 `[num_kv_heads]` (an expanded view for per-tensor)."""
    if isinstance(scale, torch.Tensor) and scale.shape == (num_kv_heads,) and scale.dtype == torch.float32:
        if scale.device == device:  # already in this form (the engine's scales): no op
            return scale
    if scale is None:
        scale = 1.0
    scale = torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(-1)
    if scale.numel() == 1:
        return scale.expand(num_kv_heads)
    if scale.numel() != num_kv_heads:
        raise ValueError(
            f"{name} has {scale.numel()} values, expected 1 (per tensor) or {num_kv_heads} (per head)"
        )
    return scale.contiguous()


def quantize_kv(values: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """K or V `[..., Hkv, D]` as stored in pages of `cache_dtype`; `scale` fp32 broadcast against values
    (`[Hkv, 1]`: per head), used by FP8 only."""
    if cache_dtype != torch.float8_e4m3fn:
        return values.to(cache_dtype)
    if values.dtype == torch.float64:
        values = values.float()
    scaled = values / scale  # fp32: a 16-bit tensor divided by an fp32 one is computed in fp32
    return scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(cache_dtype)


def dequantize_kv(pages: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Stored K or V `[..., Hkv, D]` -> fp32 values; `scale` fp32 `[Hkv]` (ignored for 16-bit pages)."""
    if pages.dtype != torch.float8_e4m3fn:
        return pages.float()
    return pages.float() * scale[:, None]


def kv_slot_rows(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor | None:
    """K and V as one `[2, num_pages * page_size, Hkv * D]` view, one row per slot, when both are
    contiguous and V lies a fixed distance after K in one allocation (the engine's pool: the halves of
    `[2, num_pages, page_size, Hkv, D]`), so the torch paths store and gather both with one op; else None.
    """
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    distance, remainder = divmod(v_cache.data_ptr() - k_cache.data_ptr(), k_cache.element_size())
    if remainder or distance < k_cache.numel() or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    row = num_kv_heads * head_dim
    try:  # as_strided checks the bounds of K's allocation: V in another one raises
        return k_cache.as_strided((2, num_pages * page_size, row), (distance, row, 1))
    except RuntimeError:
        return None


def check_decode_queries(
    q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, k_cache: torch.Tensor
) -> None:
    """q, block_tables and seq_lens against a cache already checked (ValueError/TypeError)."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(
            f"q has shape {tuple(q.shape)}, expected [B, Hq, {head_dim}] with Hq a multiple of "
            f"num_kv_heads={num_kv_heads}"
        )
    num_seqs = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or tuple(seq_lens.shape) != (num_seqs,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} must be "
            f"[{num_seqs}, max_pages] and [{num_seqs}]"
        )
    if block_tables.is_floating_point() or seq_lens.is_floating_point() or not q.is_floating_point():
        raise TypeError(
            f"block_tables and seq_lens must be integer and q float, got {block_tables.dtype}, "
            f"{seq_lens.dtype}, {q.dtype}"
        )
    if not (q.device == block_tables.device == seq_lens.device == k_cache.device):
        raise ValueError(
            f"q, block_tables, seq_lens and the caches must share a device, got {q.device}, "
            f"{block_tables.device}, {seq_lens.device}, {k_cache.device}"
        )


def default_sm_scale(head_dim: int) -> float:
    """1 / sqrt(head_dim), the softmax scale when none is given."""
    return 1.0 / math.sqrt(head_dim)


def check_store_inputs(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> tuple[int, int, int]:
    """(page_size, num_kv_heads, head_dim) after checking shapes, dtypes, devices (ValueError/TypeError)."""
    page_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_new_kv(k, v, slot_mapping, k_cache)
    return page_size, num_kv_heads, head_dim


def check_new_kv(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor) -> None:
    """The new tokens' k, v and slot_mapping against a cache already checked (ValueError/TypeError)."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    expected = (slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1, num_kv_heads, head_dim)
    if slot_mapping.dim() != 1 or k.shape != expected or v.shape != expected:
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
