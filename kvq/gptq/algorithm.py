"""GPTQ on one Linear weight: INT4 codes that minimize the layer-output error under its input Hessian.

A pure function over tensors, written to follow llm-compressor 0.14's `quantize_weight` (eager CPU path,
one module per batch) operation by operation, so that the same weight and Hessian give the same codes:
- the group scales are fixed before GPTQ, from the original weight (its observer runs first): round-to-
  nearest's `weight_scale = D(absmax / 7.5)` in the weight's dtype D (`kvq.formats.pack_quantized`), or
  with `observer="mse"` llm-compressor's MSE grid search (`kvq.gptq.observer`);
- `actorder` static (llm-compressor's `weight`): columns visited by descending Hessian diagonal, each
  keeping its own group's scale, so the output needs no `g_idx`;
- dead columns (zero Hessian diagonal) get weight 0 and diagonal 1; dampening adds
  `dampening_frac * mean(diag(H))` to the diagonal; `Hinv = cholesky(cholesky_inverse(cholesky(H)),
  upper)`;
- blocks of `block_size` columns: within a block each column is quantized as compressed-tensors'
  fake-quantize does (`x / scale` in fp32, clamp to [-8, 7], round half to even, `D(q) * scale` in D)
  and its error spread over the block's later columns; after a block, `Err @ Hinv[block, rest]` (bmm)
  updates the rest.
Tensors keep llm-compressor's batch dimension of 1 so the same BLAS calls run.

GPTAQ (asymmetric calibration, Li et al. 2025; `kvq compress --method gptaq`) also takes `asymmetry`, the
normalized `2 (X_fp - X)^T X` of the layer's inputs in the full-precision model (X_fp) and in the
quantized one (X), and follows the authors' reference implementation (`gptaq_utils.py`): `P = alpha *
triu(asymmetry @ Hinv^T, 1) @ Hinv`, and every update of the later columns also adds `w P[i, i:]` (`w`:
the column before it is quantized; after a block, the block's working columns times `P[block, rest]`),
so the codes fit the full-precision model's outputs rather than the quantized model's own. `alpha` scales
the correction (the reference's default 0.25). With `asymmetry` None the arithmetic is GPTQ's, op for op.
Imports torch and kvq.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvq.formats.pack_quantized import INT4_MAX, INT4_MIN
from kvq.gptq.gptq_config import GPTAQ_ALPHA
from kvq.gptq.observer import observe_weight_scale


class HessianNotPositiveDefinite(ValueError):
    """Cholesky failed on the dampened Hessian (llm-compressor silently falls back to RTN here)."""


@dataclass(frozen=True)
class GptqResult:
    codes: torch.Tensor  # [out, in] int8 in [-8, 7], original column order
    weight_scale: torch.Tensor  # [out, in / group_size] in the weight's dtype
    loss: float  # GPTQ's sum of squared scaled errors / 2 (llm-compressor logs the same "error")


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    *,
    group_size: int,
    block_size: int = 128,
    dampening_frac: float = 0.01,
    actorder: bool = True,
    observer: str = "minmax",
    observer_kwargs: dict[str, float] | None = None,
    asymmetry: torch.Tensor | None = None,
    alpha: float = GPTAQ_ALPHA,
) -> GptqResult:
    """GPTQ codes and scales of `weight` `[out, in]` (its dtype D sets the scale dtype) given the normalized
    input Hessian `hessian` `[in, in]` fp32 (GPTAQ's with `asymmetry` `[in, in]` fp32, scaled by `alpha`);
    `HessianNotPositiveDefinite` if dampening does not make it PD."""
    rows, cols = weight.shape
    weight_scale = observe_weight_scale(weight, group_size, observer, observer_kwargs)  # [out, G] in D
    W = weight.to(torch.float32, copy=True).unsqueeze(0)  # [1, out, in]
    H = hessian.to(torch.float32, copy=True).unsqueeze(0)  # [1, in, in]
    g_idx = (torch.arange(cols, dtype=torch.int32) // group_size).unsqueeze(0)  # [1, in]
    A = None if asymmetry is None else asymmetry.to(torch.float32, copy=True).unsqueeze(0)  # [1, in, in]
    perm = None
    if actorder:
        perm = torch.argsort(torch.diagonal(H, dim1=-2, dim2=-1), dim=-1, descending=True)  # [1, in]
        H = torch.gather(H, -1, perm.unsqueeze(-2).expand(-1, cols, -1))
        H = torch.gather(H, -2, perm.unsqueeze(-1).expand(-1, -1, cols))
        W = torch.gather(W, -1, perm.unsqueeze(-2).expand(-1, rows, -1))
        g_idx = torch.gather(g_idx, 1, perm)
        if A is not None:
            A = torch.gather(A, -1, perm.unsqueeze(-2).expand(-1, cols, -1))
            A = torch.gather(A, -2, perm.unsqueeze(-1).expand(-1, -1, cols))
    Hinv = _inverse_factor(W, H, dampening_frac, A)  # [1, in, in], upper triangular
    P = None if A is None else alpha * torch.triu(A @ Hinv.mT, diagonal=1) @ Hinv  # [1, in, in]
    codes = torch.empty(1, rows, cols, dtype=torch.int8)
    loss = torch.zeros(1, rows)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        Q1, Err1, W1 = _quantize_block(W, Hinv, P, weight_scale, g_idx, codes, i1, i2)
        W[:, :, i1:i2] = Q1
        loss += torch.sum(Err1.square(), 2) / 2
        W[:, :, i2:] -= torch.bmm(Err1, Hinv[:, i1:i2, i2:])
        if P is not None:
            W[:, :, i2:] += torch.bmm(W1, P[:, i1:i2, i2:])
    if perm is not None:
        codes = torch.gather(codes, -1, torch.argsort(perm, dim=-1).unsqueeze(-2).expand(-1, rows, -1))
    return GptqResult(codes[0], weight_scale, float(loss.sum()))


def _inverse_factor(
    W: torch.Tensor, H: torch.Tensor, dampening_frac: float, A: torch.Tensor | None = None
) -> torch.Tensor:
    """Dampen `H` and return the upper Cholesky factor of its inverse; zero `W`'s dead columns (and `A`'s
    columns for them, in place)."""
    diag = torch.diagonal(H, dim1=-2, dim2=-1)
    dead = diag == 0
    if dead.any():
        diag.masked_fill_(dead, 1.0)
        W.masked_fill_(dead.unsqueeze(1), 0)
        if A is not None:
            A.masked_fill_(dead.unsqueeze(1), 0)
    H0 = H[0]
    damp = dampening_frac * torch.mean(torch.diag(H0))
    torch.diagonal(H0).add_(damp)
    L, info = torch.linalg.cholesky_ex(H0, check_errors=False)
    if int(info) != 0:
        raise HessianNotPositiveDefinite(f"leading minor {int(info)} is not positive")
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    return Hinv.unsqueeze(0)


def _quantize_block(
    W: torch.Tensor,
    Hinv: torch.Tensor,
    P: torch.Tensor | None,
    weight_scale: torch.Tensor,
    g_idx: torch.Tensor,
    codes: torch.Tensor,
    i1: int,
    i2: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Columns `i1:i2` one by one: (their quantized values `[1, out, w]` fp32, their scaled errors, the
    block's working columns after their updates)."""
    W1 = W[:, :, i1:i2].clone()
    Q1 = torch.zeros_like(W1)
    Err1 = torch.zeros_like(W1)
    Hinv1 = Hinv[:, i1:i2, i1:i2]
    P1 = None if P is None else P[:, i1:i2, i1:i2]
    scale_dtype = weight_scale.dtype
    scales = weight_scale.to(torch.float32)[:, g_idx[0, i1:i2].long()].unsqueeze(0)  # [1, out, w]
    for i in range(i2 - i1):
        w = W1[:, :, i]  # [1, out]
        s = scales[:, :, i]
        q = torch.round(torch.clamp(w / s, INT4_MIN, INT4_MAX))
        codes[:, :, i1 + i] = q.to(torch.int8)
        dequant = (q * s).to(scale_dtype).to(torch.float32)  # q * scale is exact in fp32: one rounding to D
        error = (w - dequant) / Hinv1[:, i, i][:, None]
        Q1[:, :, i] = dequant
        Err1[:, :, i] = error
        if P1 is None:
            W1[:, :, i:] -= error.unsqueeze(-1) * Hinv1[:, i, i:].unsqueeze(1)
        else:  # both terms from the column before its update (w is a view of it)
            update = error.unsqueeze(-1) * Hinv1[:, i, i:].unsqueeze(1)
            W1[:, :, i:] -= update - w.unsqueeze(-1) * P1[:, i, i:].unsqueeze(1)
    return Q1, Err1, W1
