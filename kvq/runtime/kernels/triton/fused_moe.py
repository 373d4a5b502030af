"""Triton fused MoE over INT4 experts: each GEMM is one launch over expert-sorted token blocks.

Spec: `fused_moe.fused_moe_reference`. (token, k) pairs are sorted by expert and each expert's run is
padded to BLOCK_M rows (`moe_align_block_size`, torch ops on the device, no host sync); every program
of `w4a16_kernel` (IS_MOE) then reads one expert's packed weights for one block of rows.
Launches: align (torch) -> w13 GEMM (Triton) -> SiLU*up (torch) -> w2 GEMM x routed weight (Triton)
-> sum over k (torch). Imports Triton; loaded lazily by `kvq.runtime.kernels`.
"""

from __future__ import annotations

import torch
import triton

from kvq.runtime.kernels.fused_moe import check_moe_inputs, silu_and_mul
from kvq.runtime.kernels.triton.launch import is_interpreted, kernel_for, output_dtype
from kvq.runtime.kernels.triton.w4a16 import (
    W4A16LaunchConfig,
    check_launch_config,
    launch_constexprs,
    w4a16_kernel,
)
from kvq.runtime.kernels.w4a16 import LAYOUT_COMPRESSED_TENSORS, W4A16Weight


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert-sorted pair ids padded per expert to `block_m` rows, and the expert of each block.

    Returns `sorted_ids` int32 `[num_blocks * block_m]` (pair p = t * k + j; padding = T * k) and
    `expert_ids` int32 `[num_blocks]` (-1 for unused trailing blocks). num_blocks is an upper bound
    (cdiv(T*k, block_m) + min(E, T*k)), so nothing here waits for the device.
    """
    flat = topk_ids.reshape(-1).long()  # [P]
    num_pairs = flat.numel()
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # pair ids grouped by expert
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - count_start[sorted_experts]
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[padded_start[sorted_experts] + rank] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=flat.device) * block_m
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)  # first e with end > start
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids


def choose_moe_config(num_pairs: int, num_experts: int, group_size: int) -> W4A16LaunchConfig:
    """Block rows sized to the expected rows per active expert."""
    rows_per_expert = num_pairs / max(min(num_experts, num_pairs), 1)
    block_k = min(group_size, 128)
    is_planes = block_k == 128  # see w4a16_triton.choose_config
    if rows_per_expert <= 64:
        block_m, block_n = (16 if rows_per_expert <= 16 else 32), (128 if is_planes else 64)
        return W4A16LaunchConfig(block_m, block_n, block_k, num_stages=4, nibble_planes=is_planes)
    return W4A16LaunchConfig(block_m=64, block_n=128, block_k=min(group_size, 64), num_warps=8)


def _launch_moe_gemm(
    x: torch.Tensor,
    w: W4A16Weight,
    y: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    topk_weights: torch.Tensor | None,
    top_k: int,
    num_pairs: int,
    config: W4A16LaunchConfig,
) -> None:
    assert w.weight_packed is not None and w.weight_scale is not None
    kernel = kernel_for(w4a16_kernel, x.device)
    grid = (expert_ids.numel(), triton.cdiv(w.out_features, config.block_n), 1)
    kernel[grid](
        x,
        w.weight_packed,
        w.weight_scale,
        y,
        sorted_ids,
        expert_ids,
        topk_weights,
        0,
        w.out_features,
        w.in_features,
        num_pairs,
        x.stride(0),
        x.stride(1),
        *w.weight_packed.stride(),
        *w.weight_scale.stride(),
        y.stride(0),
        y.stride(1),
        GROUP_SIZE=w.group_size,
        TOP_K=top_k,
        IS_MOE=True,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        SPLIT_K=1,
        **launch_constexprs(config, x.dtype, is_interpreted(kernel)),
    )


def fused_moe_triton(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: W4A16Weight,
    w2: W4A16Weight,
    config: W4A16LaunchConfig | None = None,
) -> torch.Tensor:
    """Triton path: x `[T, H]`, topk ids/weights `[T, k]`, w13 `[E, 2I, H]`, w2 `[E, H, I]` -> `[T, H]`."""
    check_moe_inputs(x, topk_ids, topk_weights, w13, w2)
    for name, w in (("w13", w13), ("w2", w2)):
        if w.layout != LAYOUT_COMPRESSED_TENSORS or w.device != x.device:
            raise ValueError(
                f"{name} is {w.layout} on {w.device}; prepare it with backend='triton' on {x.device}"
            )
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    num_experts = w13.num_experts
    assert num_experts is not None
    config = config or choose_moe_config(num_pairs, num_experts, w13.group_size)
    check_launch_config(config, w13.group_size)
    check_launch_config(config, w2.group_size)
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, num_experts, config.block_m)
    h_dtype = output_dtype(x.dtype, is_interpreted(kernel_for(w4a16_kernel, x.device)))
    h = torch.empty((num_pairs, w13.out_features), dtype=h_dtype, device=x.device)  # [T*k, 2I]
    _launch_moe_gemm(x, w13, h, sorted_ids, expert_ids, None, top_k, num_pairs, config)
    a = silu_and_mul(h, x.dtype)  # [T*k, I]
    routed = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [T*k]
    out = torch.empty((num_pairs, w2.out_features), dtype=torch.float32, device=x.device)  # [T*k, H]
    _launch_moe_gemm(a, w2, out, sorted_ids, expert_ids, routed, 1, num_pairs, config)
    return out.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
