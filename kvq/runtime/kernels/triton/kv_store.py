"""Triton KV store: one program per new token writes its K and V rows (all heads) into the page slot, and in
a checked pool its slot stamp (`kernels.integrity.stamp_check`) in the same program.

Spec: `paged.kv_store.store_kv_reference`. The launcher takes the layer's `PagedKVCache` (pages and fp32
`[Hkv]` scales checked once when it was made) and checks only the new K/V and slots. fp8 stores divide
with IEEE rounding (`div_rn`) and clamp to +-448 before the round-to-nearest-even cast, like the
reference. The interpreter's casts to fp8e4nv (ties away from zero; 127.99 becomes 64) and to bf16
(truncation) are wrong, so interpreted launches round in fp32 arithmetic first and the cast is then
exact. Imports Triton; loaded lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kvq.formats.fp8_e4m3 import FP8_E4M3_MAX
from kvq.runtime.kernels.kv_cache_layout import is_fp8
from kvq.runtime.kernels.triton.launch import is_interpreted, kernel_for, next_pow2

if TYPE_CHECKING:
    from kvq.runtime.kernels.paged.kv_pages import PagedKVPages


@triton.jit
def _round_to_e4m3(x):
    """fp32 (|x| <= 448) rounded to the nearest e4m3 value, ties to even, keeping the sign of zero."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step_bits = (tl.maximum(exponent, -6) - 3 + 127) << 23  # step 2^(e-3); 2^-9 for e4m3 subnormals
    step = step_bits.to(tl.float32, bitcast=True)
    rounded = ((x / step + 12582912.0) - 12582912.0) * step  # 1.5 * 2^23: fp32 add rounds to whole steps
    return tl.where(rounded == 0.0, x * 0.0, rounded)


@triton.jit
def _round_to_bf16(x):
    """fp32 rounded to the nearest bf16 value, ties to even (NaN kept)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)


@triton.jit
def store_kv_kernel(
    kv_ptrs,  # (k, v): the new rows [T, Hkv, D]
    cache_ptrs,  # (k_cache, v_cache)
    scale_ptrs,  # (k_scale, v_scale): fp32 [Hkv]
    kv_strides,  # per tensor of kv_ptrs: (t, h, d)
    cache_strides,  # per cache: (page, slot, h, d)
    scale_strides,  # per scale: (h,)
    slot_mapping_ptr,
    stamps_ptr,
    slot_stamps_ptr,
    page_size,
    stride_stamp,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    ROUND_FP8_IN_SOFTWARE: tl.constexpr,
    ROUND_BF16_IN_SOFTWARE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_STAMPS: tl.constexpr,
):
    pid_t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + pid_t).to(tl.int64)
    if slot < 0:
        return
    page = slot // page_size
    offset = slot % page_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < NUM_KV_HEADS
    mask = mask_h[:, None] & (offs_d < HEAD_DIM)[None, :]
    for i in tl.static_range(2):  # K, then V
        stride_t, stride_h, stride_d = kv_strides[i]
        stride_cp, stride_ct, stride_ch, stride_cd = cache_strides[i]
        src = tl.load(
            kv_ptrs[i] + pid_t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :] * stride_d,
            mask=mask,
            other=0.0,
        )
        dst = (
            cache_ptrs[i]
            + page * stride_cp
            + offset * stride_ct
            + offs_h[:, None] * stride_ch
            + offs_d[None, :] * stride_cd
        )
        if IS_FP8:
            scale = tl.load(scale_ptrs[i] + offs_h * scale_strides[i][0], mask=mask_h, other=1.0)
            scaled = tl.math.div_rn(src.to(tl.float32), scale[:, None])
            scaled = tl.minimum(tl.maximum(scaled, -FP8_MAX), FP8_MAX)
            if ROUND_FP8_IN_SOFTWARE:
                scaled = _round_to_e4m3(scaled)
            tl.store(dst, scaled.to(cache_ptrs[i].dtype.element_ty), mask=mask)
        else:
            value = src
            if ROUND_BF16_IN_SOFTWARE:
                value = _round_to_bf16(src.to(tl.float32))
            tl.store(dst, value.to(cache_ptrs[i].dtype.element_ty), mask=mask)
    if HAS_STAMPS:
        tl.store(stamps_ptr + slot * stride_stamp, tl.load(slot_stamps_ptr + pid_t))


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    kv: PagedKVPages,
    slot_mapping: torch.Tensor,
    stamps: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Triton path of `PagedKVCache.store` (`paged.kv_store.store_kv` checked k, v and the slots): in place,
    one program per token of `slot_mapping` `[T]`; with `stamps`, the pool's slot stamps (`kv.stamps`) and
    the tokens' (int64 `[T]`), each written slot's stamp too."""
    k_cache, v_cache, k_scale, v_scale = kv.k_cache, kv.v_cache, kv.k_scale, kv.v_scale  # [Hkv] scales
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    pool_stamps, slot_stamps = (slot_mapping, slot_mapping) if stamps is None else stamps  # unread: none
    if stamps is not None and (slot_stamps.shape != slot_mapping.shape or slot_stamps.dtype != torch.int64):
        raise ValueError(
            f"slot_stamps must be int64 {tuple(slot_mapping.shape)}, got {slot_stamps.dtype} "
            f"{tuple(slot_stamps.shape)}"
        )
    kernel = kernel_for(store_kv_kernel, k.device)
    kernel[(num_tokens,)](
        (k, v),
        (k_cache, v_cache),
        (k_scale, v_scale),
        (k.stride(), v.stride()),
        (k_cache.stride(), v_cache.stride()),
        (k_scale.stride(), v_scale.stride()),
        slot_mapping,
        pool_stamps,
        slot_stamps,
        page_size,
        0 if stamps is None else pool_stamps.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        IS_FP8=is_fp8(k_cache),
        FP8_MAX=FP8_E4M3_MAX,
        ROUND_FP8_IN_SOFTWARE=is_interpreted(kernel),
        ROUND_BF16_IN_SOFTWARE=is_interpreted(kernel) and k_cache.dtype == torch.bfloat16,
        BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim),
        HAS_STAMPS=stamps is not None,
    )
