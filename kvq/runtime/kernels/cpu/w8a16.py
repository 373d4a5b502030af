"""W8A16 linear: int8 weights with one symmetric scale per output row, 16-bit activations.

The runtime's INT8 copy of a dense weight (the lm_head's `lm_head_weights="int8"`): `weight` int8 `[N, K]`,
`weight_scale` fp32 `[N]`, real weight = weight * weight_scale[:, None], y = x @ W^T with fp32 sums.
On CPU it runs kvq's native kernel (`gemm_w8` in `cpu._linear`, on the path chosen at load) or, on the
`torch` path or no native path, `aten._weight_int8pack_mm` (K a multiple of 16: torch 2.13's op
returns wrong values or crashes for other K, where the reference runs); elsewhere the reference
(dequantized per call: memory saved, no speed). Imports torch and kvq.runtime.kernels.cpu.linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvq.runtime.kernels.cpu.isa import NATIVE_DTYPES, resolve_cpu_isa
from kvq.runtime.kernels.cpu.linear import gemm_w8

INT8_MAX = 127
_INT8PACK_K_MULTIPLE = 16  # `aten._weight_int8pack_mm` is right only for K % 16 == 0 (test_w8a16.py)


def quantize_int8_rows(
    weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense `[N, K]` -> (`weight` int8 `[N, K]`, `weight_scale` `[N]` in scale_dtype): symmetric, round to
    nearest even, scale = max |row| / 127 (an all-zero row gets scale 1); a bf16 scale is that fp32 one
    rounded up to the next bf16 (so that |w / scale| <= 127 still), the weights rounded against it."""
    w = weight.float()
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax))
    if scale_dtype == torch.bfloat16:
        near = scale.bfloat16()
        up = (near.view(torch.int16) + 1).view(torch.bfloat16)  # positive: the next bf16 up
        scale = torch.where(near.float() < scale, up, near).float()
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scale.to(scale_dtype).contiguous()


def w8a16_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The spec: fp32 `[..., N]` = x.float() @ (weight * weight_scale[:, None])^T for x `[..., K]`."""
    return x.float() @ (weight.float() * weight_scale.float()[:, None]).T


@dataclass(frozen=True)
class W8A16Weight:
    """An int8 weight ready for its path: `cpu_isa` "amx" (AMX tiles for 4+ bf16 rows with K a multiple of
    32, else avx512bf16's loops) / "avx512bf16" / "avx512" / "avx2" / "scalar" (the native kernel), "torch"
    (`aten._weight_int8pack_mm`), or None off CPU (the reference)."""

    weight: torch.Tensor  # int8 [N, K], contiguous
    weight_scale: torch.Tensor  # fp32 [N]
    cpu_isa: str | None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]


def prepare_w8a16(weight: torch.Tensor, weight_scale: torch.Tensor, isa: str | None = None) -> W8A16Weight:
    """Check an int8 weight and its row scales and pick the path for its device (once, at load): on CPU,
    `isa` (None: `resolve_cpu_isa()`)."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise TypeError(f"weight must be int8 [N, K], got {weight.dtype} {tuple(weight.shape)}")
    if tuple(weight_scale.shape) != (weight.shape[0],) or not weight_scale.is_floating_point():
        raise ValueError(
            f"weight_scale must be a float [N] = [{weight.shape[0]}], got {weight_scale.dtype} "
            f"{tuple(weight_scale.shape)}"
        )
    if weight.device.type != "cpu":
        isa = None
    elif isa is None:
        isa = resolve_cpu_isa()
    return W8A16Weight(weight.contiguous(), weight_scale.float().contiguous(), isa)


def w8a16_native(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    isa: str,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y `[M, N]` in out_dtype (default x.dtype) = x `[M, K]` @ (weight * scale)^T on native path `isa`
    (fp32 sums); x fp32, bf16 or fp16; weight int8 `[N, K]` and weight_scale fp32 or bf16 `[N]`, both
    contiguous (checked at prepare). Threads: torch.get_num_threads()."""
    if x.dtype not in NATIVE_DTYPES:
        raise TypeError(f"the CPU W8A16 kernel takes fp32, bf16 or fp16 activations, got {x.dtype}")
    x = x.contiguous()
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=out_dtype or x.dtype)
    gemm_w8(isa, x, weight, weight_scale, y)
    return y


def w8a16_linear(x: torch.Tensor, w: W8A16Weight) -> torch.Tensor:
    """y = x @ W^T for x `[..., K]` -> `[..., N]` in x.dtype, on the path `w` was prepared for."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected [..., {w.in_features}]")
    x2d = x.reshape(-1, w.in_features)
    if w.cpu_isa is None or (w.cpu_isa == "torch" and w.in_features % _INT8PACK_K_MULTIPLE):
        y = w8a16_reference(x2d, w.weight, w.weight_scale).to(x.dtype)
    elif w.cpu_isa == "torch":
        y = torch.ops.aten._weight_int8pack_mm(x2d.contiguous(), w.weight, w.weight_scale.to(x.dtype))
    else:
        y = w8a16_native(x2d, w.weight, w.weight_scale, w.cpu_isa)
    return y.reshape(*x.shape[:-1], w.out_features)
