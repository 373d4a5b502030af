"""Routed experts of a mixture-of-experts MLP: INT4 experts stacked for `kernels.fused_moe_of`, any
other stored form run expert by expert with the same arithmetic (SiLU(gate) * up in the activation dtype,
fp32 sums). Routing (which experts, which weights) is the model's job.
Imports torch and kvq.runtime.kernels / kvq.runtime.layers.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvq.runtime.kernels import W4A16Weight, fused_moe_of, prepare_w4a16
from kvq.runtime.layers.linear import INT4, Linear, LinearForms, StoredLinear, build_linear, merge_stored

WEIGHT_KEYS = ("weight_packed", "weight_scale")


class Experts:
    """y `[T, H]` = sum_j topk_weights[:, j] * expert[topk_ids[:, j]](x)."""

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError


class Int4Experts(Experts):
    def __init__(self, w13, w2) -> None:  # W4A16Weight [E, 2I, H] (gate rows, then up rows), [E, H, I]
        self.w13, self.w2 = w13, w2
        self.kernel = fused_moe_of(w13, w2)  # the backend's, bound at load

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, topk_ids, topk_weights)

    def tensors(self) -> list[torch.Tensor]:
        return self.w13.tensors() + self.w2.tensors()


class LoopExperts(Experts):
    def __init__(self, gate_up: list[Linear], down: list[Linear]) -> None:
        self.gate_up, self.down = gate_up, down

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
        for e in topk_ids.unique().tolist():
            token_idx, slot_idx = (topk_ids == e).nonzero(as_tuple=True)
            gate, up = self.gate_up[e](x[token_idx]).float().chunk(2, dim=-1)
            a = (F.silu(gate) * up).to(x.dtype)  # [n, I]
            out = self.down[e](a).float() * topk_weights[token_idx, slot_idx].float()[:, None]
            y.index_add_(0, token_idx, out)
        return y.to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in (*self.gate_up, *self.down) for t in layer.tensors()]


def build_experts(gate_up: list[list[StoredLinear]], down: list[StoredLinear], forms: LinearForms) -> Experts:
    """Stack all-INT4 experts for the fused kernel (on CPU under int4_compute "w4a8", in the W4A8 kernel's
    layout); otherwise build one Linear pair per expert."""
    merged = [merge_stored(parts) for parts in gate_up]
    group_sizes = {s.group_size for s in (*merged, *down) if s is not None and s.kind == INT4}
    is_all_int4 = all(s is not None and s.kind == INT4 and s.bias is None for s in (*merged, *down))
    if is_all_int4 and len(group_sizes) == 1 and not forms.is_reference:
        group_size = group_sizes.pop()

        def prepare(stored: list) -> W4A16Weight:
            packed, scale = (
                torch.stack([s.tensors[k] for s in stored]).to(forms.device) for k in WEIGHT_KEYS
            )
            return prepare_w4a16(
                packed,
                scale,
                group_size,
                backend=forms.backend,
                int8_activations=forms.is_w4a8,
                cpu_ops=forms.cpu_ops,
            )

        return Int4Experts(prepare(merged), prepare(down))
    return LoopExperts(
        [build_linear(parts, forms) for parts in gate_up], [build_linear([d], forms) for d in down]
    )
