"""RMSNorm (Llama, GLM, MLA) and LayerNorm (GLM-5's DSA indexer). RMSNorm is torch's fused rms_norm,
which normalizes in fp32 and rounds once (transformers rounds the normalized value, then the product
with the weight: a bf16 rounding step apart; equal in fp32). On CPU, bf16 rows go through kvq's C op
(the engine's `CpuOps.rms_norm`: the same rounding, one call instead of ~8 eager ops), with the residual
add fused in `add_norm`. Imports torch and kvq.runtime.kernels.cpu.ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvq.runtime.kernels.cpu.ops import CpuOps


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float, ops: CpuOps) -> None:
        # [H]; the engine's CPU kernels where they run on the weight's device (else None: torch's)
        self.weight, self.eps, self.ops = weight, eps, ops.on(weight.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x * rsqrt(mean(x^2) + eps) * weight, in fp32 inside, rounded once to x.dtype."""
        if self.ops is not None and self.weight.dtype == x.dtype and self.ops.applies(x):
            return self.ops.rms_norm(x, self.weight, self.eps)[0]
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(s), s) for s = x + residual (rounded to x.dtype first, as torch's add)."""
        ops = self.ops
        if ops is not None and self.weight.dtype == x.dtype and residual.is_contiguous() and ops.applies(x):
            return ops.rms_norm(x, self.weight, self.eps, residual)
        total = x + residual
        return self(total), total

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight]


class LayerNorm:
    """torch's layer_norm with weight and bias (GLM-5's DSA indexer `k_norm`), in fp32 inside."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> None:
        self.weight, self.bias, self.eps = weight, bias, eps  # [D], [D]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.bias]
