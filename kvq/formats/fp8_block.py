"""FP8-block weights (DeepSeek-V3 / GLM-5-FP8 layout): float8_e4m3fn `weight` + fp32 `weight_scale_inv`.

`real = weight.float() * weight_scale_inv[block]` over 128x128 blocks; edge blocks are partial.
Pure functions over tensors; used by fixtures (quantize), compress, calibrate and the runtime (dequantize).
"""

from __future__ import annotations

import torch

from kvq.formats.shapes import DEFAULT_BLOCK, scale_inv_shape

FP8_E4M3_MAX = 448.0


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
