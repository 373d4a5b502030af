"""FP8-block weights (DeepSeek-V3 / GLM-5-FP8 layout): float8_e4m3fn `weight` + fp32 `weight_scale_inv`.

`real = weight.float() * weight_scale_inv[block]` over 128x128 blocks; edge blocks are partial.
Pure functions over tensors; used by fixtures (quantize), compress, calibrate and the runtime (dequantize).
`dequantize_fp8_block` is the spec; `decode_fp8_block` the fast path (bit moves), bit-identical to it.
"""

from __future__ import annotations

import torch

from kvq.formats.fp8_e4m3 import FP8_BITS_SCALE, FP8_E4M3_MAX
from kvq.formats.shapes import DEFAULT_BLOCK, scale_inv_shape


def _expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Repeat a per-block scale to the weight's full shape (cropping partial edge blocks)."""
    full = scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[: shape[0], : shape[1]]


def dequantize_fp8_block(
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """fp8 `[M, N]` x fp32 scale `[ceil(M/bm), ceil(N/bn)]` -> `[M, N]` in `dtype`, computed in fp32."""
    rows, cols = weight.shape
    expected = scale_inv_shape((rows, cols), block)
    if tuple(weight_scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv has shape {tuple(weight_scale_inv.shape)}, expected {expected} "
            f"for a weight of shape {(rows, cols)} with block {block}"
        )
    scale = _expand_blocks(weight_scale_inv.to(torch.float32), (rows, cols), block)
    return (weight.to(torch.float32) * scale).to(dtype)


def decode_fp8_block(
    bits: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fp8_bits_to(weight, bf16)` `[M, N]` x scale `[ceil(M/bm), ceil(N/bn)]` -> fp32 `[M, N]`, equal to
    `dequantize_fp8_block` bit for bit (~10x faster), written into `out` if given.

    `bf16 -> fp32` is a shift; one multiply by `scale_inv * 2^120` per block row (no `[M, N]` scale
    tensor) rounds once, as `value * scale_inv` does.
    """
    rows, cols = bits.shape
    bm, bn = block
    if out is None:
        out = torch.empty(rows, cols)
    x = out.copy_(bits)  # value * 2^-120, exact
    scale = weight_scale_inv.to(torch.float32)
    is_safe = bool((scale.abs() < 2.0**7).all())  # then scale * 2^120 is exact (finite)
    if not is_safe:
        x.mul_(FP8_BITS_SCALE)  # exact: back to the value itself
    col_scale = scale.repeat_interleave(bn, dim=1)[:, :cols]  # [ceil(M/bm), N]
    if is_safe:
        col_scale = col_scale * FP8_BITS_SCALE
    for r in range(col_scale.shape[0]):
        x[r * bm : (r + 1) * bm].mul_(col_scale[r])
    return x


def quantize_fp8_block(
    weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[M, N]` float -> (float8_e4m3fn `[M, N]`, fp32 `weight_scale_inv` `[ceil(M/bm), ceil(N/bn)]`).

    Per-block scale `amax / 448` (an all-zero block gets scale 1), as DeepSeek-V3's fp8 cast does.
    """
    rows, cols = weight.shape
    bm, bn = block
    nrb, ncb = scale_inv_shape((rows, cols), block)
    w = weight.to(torch.float32)
    padded = torch.zeros(nrb * bm, ncb * bn, dtype=torch.float32)
    padded[:rows, :cols] = w
    blocks = padded.reshape(nrb, bm, ncb, bn)  # [nrb, bm, ncb, bn]
    amax = blocks.abs().amax(dim=(1, 3))  # [nrb, ncb]
    weight_scale_inv = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    scale = _expand_blocks(weight_scale_inv, (rows, cols), block)
    weight_fp8 = (w / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return weight_fp8, weight_scale_inv
