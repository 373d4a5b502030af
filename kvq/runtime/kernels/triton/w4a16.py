"""Triton W4A16 GEMM/GEMV reading the compressed-tensors pack-quantized layout directly (no repack).

Spec: `w4a16.w4a16_reference`. One kernel serves dense linears (rows = x rows, split-K for decode GEMVs)
and the fused MoE (rows gathered from expert-sorted token blocks, see `triton/fused_moe.py`). Each K
tile lies inside one scale group, so its int4 dot product is scaled once, in fp32. Two unpack paths:
a reshape into natural k order (any tile), and nibble planes (128-deep tiles, 16-bit dots) that skip
int->float conversions and layout shuffles. Imports Triton; loaded lazily by `kvq.runtime.kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl

from kvq.runtime.kernels.triton.launch import (
    dot,
    dot_constexprs,
    dot_dtype,
    is_interpreted,
    kernel_for,
    output_dtype,
    sm_count_for,
)
from kvq.runtime.kernels.w4a16 import LAYOUT_COMPRESSED_TENSORS, W4A16Weight


@triton.jit
def _nibble_planes_dot(
    x_base,
    x_tile,
    packed,
    offs_kw,
    stride_xk,
    mask_m,
    DOT_DTYPE: tl.constexpr,
    MAGIC_BITS: tl.constexpr,
    MAGIC_OFFSET: tl.constexpr,
):
    """x tile @ (q tile): `[BLOCK_M, BLOCK_N]` fp32, unscaled, as 8 dots over nibble planes (k = 8*kw + j
    for plane j), so the packed words `[BLOCK_K/8, BLOCK_N]` never change layout; nibble u becomes the
    16-bit float MAGIC + u by OR-ing its bits into MAGIC_BITS (no int->float conversion), and
    MAGIC_OFFSET * sum(x) takes the bias back out."""
    x_sum = tl.sum(x_tile.to(DOT_DTYPE).to(tl.float32), axis=1)  # one reduction per tile
    part = tl.zeros((x_tile.shape[0], packed.shape[1]), dtype=tl.float32)
    for j in tl.static_range(8):
        offs_kj = (offs_kw * 8 + j).to(tl.int64)  # plane j: k = 8 * kw + j
        x = tl.load(x_base + offs_kj[None, :] * stride_xk, mask=mask_m[:, None], other=0.0)
        bits = ((packed >> (4 * j)) & 0xF) | MAGIC_BITS
        w = bits.to(tl.int16).to(DOT_DTYPE, bitcast=True)  # [BLOCK_K/8, BLOCK_N], exactly MAGIC + u
        part += tl.dot(x.to(DOT_DTYPE), w)
    return part - MAGIC_OFFSET * x_sum[:, None]


@triton.jit
def _natural_order_dot(x_tile, packed, DOT_DTYPE: tl.constexpr, IS_FP32_DOT: tl.constexpr):
    """x tile @ (q tile): `[BLOCK_M, BLOCK_N]` fp32, unscaled, with the packed words `[BLOCK_K/8, BLOCK_N]`
    unpacked into natural k order."""
    shifts = tl.arange(0, 8) * 4
    nibbles = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K/8, 8, BLOCK_N]
    q = tl.reshape(nibbles, (x_tile.shape[1], packed.shape[1])) - 8  # row 8*kw + j = k
    return dot(x_tile.to(DOT_DTYPE), q.to(DOT_DTYPE), IS_FP32_DOT)


@triton.jit
def w4a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    topk_weights_ptr,
    M,
    N,
    K,
    num_pairs,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sg,
    stride_ym,
    stride_yn,
    GROUP_SIZE: tl.constexpr,
    TOP_K: tl.constexpr,
    IS_MOE: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IS_FP32_DOT: tl.constexpr,
    NIBBLE_PLANES: tl.constexpr,
    MAGIC_BITS: tl.constexpr,
    MAGIC_OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if IS_MOE:
        # rows are (token, k) pairs sorted by expert; x row = pair // TOP_K; padding pairs == num_pairs
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        if expert < 0:
            return
        rows = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
        mask_m = rows < num_pairs
        x_rows = rows // TOP_K
    else:
        expert = 0
        rows = offs_m.to(tl.int64)
        mask_m = rows < M
        x_rows = rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_n64 = offs_n.to(tl.int64)
    num_k_tiles = K // BLOCK_K
    tiles_per_split = tl.cdiv(num_k_tiles, SPLIT_K)
    tile_start = pid_k * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_k_tiles)
    x_base = x_ptr + x_rows[:, None] * stride_xm
    w_base = w_ptr + expert * stride_we + offs_n64[None, :] * stride_wn
    s_base = s_ptr + expert * stride_se + offs_n64 * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(tile_start, tile_end):
        offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        x_tile = tl.load(x_base + offs_k[None, :].to(tl.int64) * stride_xk, mask=mask_m[:, None], other=0.0)
        offs_kw = tile * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(w_base + offs_kw[:, None].to(tl.int64) * stride_wk, mask=mask_n[None, :], other=0)
        if NIBBLE_PLANES:
            part = _nibble_planes_dot(
                x_base, x_tile, packed, offs_kw, stride_xk, mask_m, DOT_DTYPE, MAGIC_BITS, MAGIC_OFFSET
            )
        else:
            part = _natural_order_dot(x_tile, packed, DOT_DTYPE, IS_FP32_DOT)
        scale = tl.load(s_base + ((tile * BLOCK_K) // GROUP_SIZE) * stride_sg, mask=mask_n, other=0.0)
        acc += part * scale.to(tl.float32)[None, :]

    if MUL_ROUTED_WEIGHT:
        routed = tl.load(topk_weights_ptr + rows, mask=mask_m, other=0.0).to(tl.float32)
        acc = acc * routed[:, None]
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n64[None, :] * stride_yn
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask)


# 16-bit float bits of 2^p with ulp 1 (OR a nibble u in: the value 2^p + u), and 2^p + 8 (u = q + 8)
_MAGIC = {torch.bfloat16: (0x4300, 136.0), torch.float16: (0x6400, 1032.0)}


@dataclass(frozen=True)
class W4A16LaunchConfig:
    """Tiles of one launch: block_k divides the group size; split_k > 1 accumulates atomically;
    nibble_planes (block_k 128, 16-bit dots) unpacks without int->float conversions or a reshape."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    nibble_planes: bool = False


def choose_config(
    num_rows: int, out_features: int, in_features: int, group_size: int, device: torch.device
) -> W4A16LaunchConfig:
    """Heuristic tiles (no autotuning): GEMV-shaped launches split K until the GPU has ~4 programs per SM.

    Decode sizes use nibble planes when the group allows 128-deep tiles: by sm_90 SASS counts their loop
    issues ~70 instructions per KB of packed weights at block_n 128, the reshape path ~205 (64 I2F per
    4 KB); `python -m kvq.bench.kernels` sweeps both on a GPU.
    """
    block_k = min(group_size, 128)
    is_planes = block_k == 128
    if num_rows <= 64:
        block_m, block_n = (16 if num_rows <= 16 else 32), (128 if is_planes else 64)
        config = W4A16LaunchConfig(block_m, block_n, block_k, num_stages=4, nibble_planes=is_planes)
    else:
        config = W4A16LaunchConfig(block_m=64, block_n=128, block_k=min(group_size, 64), num_warps=8)
    programs = triton.cdiv(num_rows, config.block_m) * triton.cdiv(out_features, config.block_n)
    num_k_tiles = in_features // config.block_k
    split_k = 1
    while programs * split_k * 2 <= 4 * sm_count_for(device) and num_k_tiles // (split_k * 2) >= 2:
        split_k *= 2
    return replace(config, split_k=split_k)


def check_launch_config(config: W4A16LaunchConfig, group_size: int) -> None:
    """Raise ValueError when a config breaks the kernel's assumptions."""
    if group_size % config.block_k or config.block_k % 16 or config.block_m < 16 or config.block_n < 16:
        raise ValueError(f"{config}: block_k must divide group_size {group_size}; all blocks >= 16")
    if config.nibble_planes and config.block_k != 128:
        raise ValueError(f"{config}: nibble_planes needs block_k 128 (16-deep dots per nibble plane)")


def launch_constexprs(config: W4A16LaunchConfig, dtype: torch.dtype, interpreted: bool) -> dict[str, Any]:
    """The kernel's tiles, dot operands for `dtype` activations and unpack constexprs (nibble planes with
    magic numbers for 16-bit dots, else a reshape), and the launch's warps and stages."""
    operand_dtype = dot_dtype(dtype, interpreted)
    magic_bits, magic_offset = _MAGIC.get(operand_dtype, (0, 0.0))
    return {
        **dot_constexprs(dtype, interpreted),
        "NIBBLE_PLANES": config.nibble_planes and operand_dtype in _MAGIC,
        "MAGIC_BITS": magic_bits,
        "MAGIC_OFFSET": magic_offset,
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }


def w4a16_linear_triton(
    x: torch.Tensor, w: W4A16Weight, config: W4A16LaunchConfig | None = None
) -> torch.Tensor:
    """Triton path: x `[M, K]` (fp16/bf16/fp32, any strides) -> `[M, N]` in x.dtype."""
    if w.layout != LAYOUT_COMPRESSED_TENSORS or w.num_experts is not None:
        raise ValueError(
            f"w4a16_linear_triton needs a plain compressed-tensors weight, got {w.layout} "
            f"with num_experts={w.num_experts}: prepare it with backend='triton'"
        )
    assert w.weight_packed is not None and w.weight_scale is not None
    if x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected [M, {w.in_features}]")
    if x.device != w.weight_packed.device:
        raise ValueError(f"x is on {x.device} but the weight is on {w.weight_packed.device}")
    if w.weight_packed.stride(-1) != 1 or w.weight_scale.stride(-1) != 1:
        raise ValueError("weight_packed and weight_scale must be contiguous in their last dim")
    num_rows = x.shape[0]
    config = config or choose_config(num_rows, w.out_features, w.in_features, w.group_size, x.device)
    check_launch_config(config, w.group_size)
    kernel = kernel_for(w4a16_kernel, x.device)
    y_dtype = torch.float32 if config.split_k > 1 else output_dtype(x.dtype, is_interpreted(kernel))
    alloc = torch.zeros if config.split_k > 1 else torch.empty
    y = alloc((num_rows, w.out_features), device=x.device, dtype=y_dtype)  # [M, N]
    if num_rows == 0:
        return y.to(x.dtype)
    grid = (
        triton.cdiv(num_rows, config.block_m),
        triton.cdiv(w.out_features, config.block_n),
        config.split_k,
    )
    kernel[grid](
        x,
        w.weight_packed,
        w.weight_scale,
        y,
        None,
        None,
        None,
        num_rows,
        w.out_features,
        w.in_features,
        0,
        x.stride(0),
        x.stride(1),
        0,
        w.weight_packed.stride(0),
        w.weight_packed.stride(1),
        0,
        w.weight_scale.stride(0),
        w.weight_scale.stride(1),
        y.stride(0),
        y.stride(1),
        GROUP_SIZE=w.group_size,
        TOP_K=1,
        IS_MOE=False,
        MUL_ROUTED_WEIGHT=False,
        SPLIT_K=config.split_k,
        **launch_constexprs(config, x.dtype, is_interpreted(kernel)),
    )
    return y.to(x.dtype)
