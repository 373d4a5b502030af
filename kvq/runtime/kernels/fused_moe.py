"""Mixture-of-experts MLP over INT4 experts: reference (the spec) and the torch path.

For each token t and each of its k routed experts e = topk_ids[t, j]:
  h = x[t] @ w13[e]^T  (w13 rows: gate_proj rows 0..I-1, then up_proj rows I..2I-1)
  a = SiLU(h[:I]) * h[I:], rounded to x.dtype (the kernels keep `a` in the activation dtype)
  y[t] += topk_weights[t, j] * (a @ w2[e]^T)
Sums are fp32; y is returned in x.dtype. Renormalising topk_weights is the caller's job.
The Triton path is in `triton/fused_moe.py`. Imports torch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvq.formats.pack_quantized import dequantize_pack_quantized
from kvq.runtime.kernels.w4a16 import W4A16Weight, w4a16_linear_torch


def check_moe_inputs(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: W4A16Weight, w2: W4A16Weight
) -> None:
    """Raise ValueError naming the argument when shapes or dtypes break the fused-MoE contract."""
    if w13.num_experts is None or w2.num_experts != w13.num_experts:
        raise ValueError(
            f"w13 and w2 must be stacked experts with the same E, got {w13.num_experts}, {w2.num_experts}"
        )
    hidden, intermediate = w13.in_features, w2.in_features
    if w13.out_features != 2 * intermediate or w2.out_features != hidden:
        raise ValueError(
            f"w13 is [E, {w13.out_features}, {w13.in_features}] and "
            f"w2 [E, {w2.out_features}, {w2.in_features}]; "
            "expected w13 [E, 2*I, H] (gate then up) and w2 [E, H, I]"
        )
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected [T, {hidden}]")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both "
            f"be [T, k] with T = {x.shape[0]}"
        )
    if topk_ids.is_floating_point() or not topk_weights.is_floating_point():
        raise TypeError(
            f"topk_ids must be integer and topk_weights float, got {topk_ids.dtype}, {topk_weights.dtype}"
        )


def silu_and_mul(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[..., 2I]` -> SiLU(gate) * up `[..., I]`, computed in fp32 and returned in `dtype`."""
    gate, up = h.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(dtype)


def fused_moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """The spec on pack-quantized experts (`[E, 2I, H/8]`, `[E, H, I/8]` + scales): fp32 `[T, H]`."""
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for e in topk_ids.unique().tolist():
        token_idx, slot_idx = (topk_ids == e).nonzero(as_tuple=True)
        w13 = dequantize_pack_quantized(w13_packed[e], w13_scale[e], dtype=torch.float32)  # [2I, H]
        w2 = dequantize_pack_quantized(w2_packed[e], w2_scale[e], dtype=torch.float32)  # [H, I]
        a = silu_and_mul(x[token_idx].float() @ w13.T, x.dtype)  # [n, I]
        out = (a.float() @ w2.T) * topk_weights[token_idx, slot_idx].float()[:, None]
        y.index_add_(0, token_idx, out)
    return y


def fused_moe_torch(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: W4A16Weight, w2: W4A16Weight
) -> torch.Tensor:
    """Torch path: loop over the active experts with the W4A16 torch linear; `[T, H]` in x.dtype."""
    check_moe_inputs(x, topk_ids, topk_weights, w13, w2)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for e in topk_ids.unique().tolist():
        token_idx, slot_idx = (topk_ids == e).nonzero(as_tuple=True)
        a = silu_and_mul(w4a16_linear_torch(x[token_idx], w13, expert=e), x.dtype)  # [n, I]
        out = w4a16_linear_torch(a, w2, expert=e).float() * topk_weights[token_idx, slot_idx].float()[:, None]
        y.index_add_(0, token_idx, out)
    return y.to(x.dtype)
