"""compressed-tensors `pack-quantized` INT4 weights: `weight_packed` int32 `[out, in/8]` + `weight_scale` `[out, in/g]`.

Packing: `word[r, k] = sum_j (q[r, 8k+j] + 8) << 4j` (first element in the lowest bits); symmetric, so
`real = q * weight_scale[group]` with q in [-8, 7]. Pure functions; the quantizer lives beside these.
"""

from __future__ import annotations

import torch

PACK_FACTOR = 8  # int4 values per int32 word
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # [8]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 `[N, K]` in [-8, 7] (K a multiple of 8) -> int32 `[N, K/8]`."""
    rows, cols = q.shape
    assert cols % PACK_FACTOR == 0, f"in_features {cols} is not a multiple of {PACK_FACTOR}"
    nibbles = (q.to(torch.int32) + 8).reshape(rows, cols // PACK_FACTOR, PACK_FACTOR)  # [N, K/8, 8]
    shifted = nibbles << _SHIFTS.to(q.device)
    word = shifted[..., 0]
    for j in range(1, PACK_FACTOR):  # bit fields never overlap, so OR is exact (and wraps into the sign bit)
        word = word | shifted[..., j]
    return word


def unpack_int4(weight_packed: torch.Tensor, in_features: int | None = None) -> torch.Tensor:
    """int32 `[N, K/8]` -> int8 `[N, K]` in [-8, 7] (cropped to `in_features` if given)."""
    rows, words = weight_packed.shape
    nibbles = (weight_packed.unsqueeze(-1) >> _SHIFTS.to(weight_packed.device)) & 0xF  # [N, K/8, 8]
    q = (nibbles - 8).to(torch.int8).reshape(rows, words * PACK_FACTOR)
    return q if in_features is None else q[:, :in_features]


def dequantize_pack_quantized(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: tuple[int, int] | torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Packed INT4 + group scales -> dense `[N, K]` in `dtype` (default: the scale's dtype)."""
    rows = weight_packed.shape[0]
    in_features = int(weight_shape[1]) if weight_shape is not None else weight_packed.shape[1] * PACK_FACTOR
    q = unpack_int4(weight_packed, in_features)
    num_groups = weight_scale.shape[1]
    if in_features % num_groups or weight_scale.shape[0] != rows:
        raise ValueError(f"weight_scale shape {tuple(weight_scale.shape)} does not fit weight shape {(rows, in_features)}")
    group_size = in_features // num_groups
    scale = weight_scale.to(torch.float32).repeat_interleave(group_size, dim=1)  # [N, K]
    return (q.to(torch.float32) * scale).to(dtype or weight_scale.dtype)
