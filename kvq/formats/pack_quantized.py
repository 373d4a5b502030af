"""Pack-quantized INT4 (compressed-tensors): `weight_packed` `[out, in/8]`, `weight_scale` `[out, in/g]`.

Packing: `word[r, k] = sum_j (q[r, 8k+j] + 8) << 4j` (first element in the lowest bits); symmetric, so
`real = q * weight_scale[group]` with q in [-8, 7]. Pure functions.

The quantizer reproduces compressed-tensors' W4A16 arithmetic bit for bit (its `calculate_qparams` and
`quantize` on a weight of dtype D): `weight_scale = D(absmax(group) / 7.5)`, a zero scale replaced by D's eps,
`q = round_half_even(clamp(D(w / weight_scale), -8, 7))`. Everything is computed in fp32 and rounded to D
exactly where D-typed torch ops round, which is what makes it several times faster than the library.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvq.formats.shapes import PACK_FACTOR

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # [8]
INT4_MIN, INT4_MAX = -8, 7


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 `[N, K]` in [-8, 7] (K a multiple of 8) -> int32 `[N, K/8]`."""
    rows, cols = q.shape
    assert cols % PACK_FACTOR == 0, f"in_features {cols} is not a multiple of {PACK_FACTOR}"
    return _pack_nibbles((q + 8).to(torch.uint8))


def _pack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 `[N, K]` in [0, 15] -> int32 `[N, K/8]`: two nibbles per byte, low nibble first.

    Four such bytes read as one little-endian int32 are exactly `sum_j nibble_j << 4j`.
    """
    rows, cols = nibbles.shape
    pairs = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)  # [N, K/2] uint8
    return pairs.contiguous().view(torch.int32).reshape(rows, cols // PACK_FACTOR)


def unpack_int4(weight_packed: torch.Tensor, in_features: int | None = None) -> torch.Tensor:
    """int32 `[..., N, K/8]` -> int8 `[..., N, K]` in [-8, 7] (cropped to `in_features` if given); leading
    dims are stacked experts."""
    nibbles = (weight_packed.unsqueeze(-1) >> _SHIFTS.to(weight_packed.device)) & 0xF  # [..., N, K/8, 8]
    q = (nibbles - 8).to(torch.int8).flatten(-2)  # [..., N, K]
    return q if in_features is None else q[..., :in_features]


def dequantize_pack_quantized(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: Sequence[int] | torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Packed INT4 `[..., N, K/8]` + group scales `[..., N, K/G]` -> dense `[..., N, K]` = q * scale,
    computed in fp32 and returned in `dtype` (default: the scale's dtype). The one INT4 dequantizer:
    checkpoints, the runtime's references and its dense fallbacks all use it."""
    in_features = int(weight_shape[-1]) if weight_shape is not None else weight_packed.shape[-1] * PACK_FACTOR
    q = unpack_int4(weight_packed, in_features)
    num_groups = weight_scale.shape[-1]
    if in_features % num_groups or weight_scale.shape[:-1] != weight_packed.shape[:-1]:
        raise ValueError(
            f"weight_scale shape {tuple(weight_scale.shape)} does not fit weight shape "
            f"{(*weight_packed.shape[:-1], in_features)}"
        )
    group_size = in_features // num_groups
    scale = weight_scale.to(torch.float32).repeat_interleave(group_size, dim=-1)  # [..., N, K]
    return (q.to(torch.float32) * scale).to(dtype or weight_scale.dtype)


def _group_scales(x: torch.Tensor, group_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `x` `[N, K]` of `dtype` values -> (groups `[N, K/g, g]`, weight_scale in dtype `[N, K/g, 1]`)."""
    rows, cols = x.shape
    if cols % group_size:
        raise ValueError(f"in_features {cols} is not a multiple of group_size {group_size}")
    groups = x.view(rows, cols // group_size, group_size)  # [N, G, g]
    # min/max widened to include 0 then max(|min|, |max|) is absmax; `D(a) / D(7.5)` rounds once to D.
    absmax = torch.maximum(groups.amax(dim=-1, keepdim=True), groups.amin(dim=-1, keepdim=True).neg_())
    weight_scale = (absmax.clamp_min_(0) / 7.5).to(dtype)  # [N, G, 1]
    weight_scale.masked_fill_(weight_scale == 0, torch.finfo(dtype).eps)
    return groups, weight_scale


def _quantize_groups_(groups: torch.Tensor, weight_scale: torch.Tensor) -> None:
    """fp32 groups `[N, G, g]` -> q in [-8, 7], in place."""
    groups.div_(weight_scale.to(torch.float32))
    if weight_scale.dtype != torch.float32:  # `D(w) / D(s)` is rounded to D before round/clamp
        round_to_(groups, weight_scale.dtype)
    groups.round_().clamp_(INT4_MIN, INT4_MAX)


def round_to_(x: torch.Tensor, dtype: torch.dtype) -> None:
    """Round fp32 `x` to the nearest `dtype` value (as `x.to(dtype)` does), in place."""
    x.copy_(x.to(dtype))


def quantize_int4_group(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float `[N, K]` -> (q int8 `[N, K]` in [-8, 7], weight_scale `[N, K/group_size]` in weight.dtype).

    Symmetric round-to-nearest, bit-identical to compressed-tensors' W4A16 group quantization of `weight`.
    """
    x = weight.to(torch.float32, copy=True)
    groups, weight_scale = _group_scales(x, group_size, weight.dtype)
    _quantize_groups_(groups, weight_scale)
    return x.to(torch.int8), weight_scale.squeeze(-1)


def quantize_pack_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float `[N, K]` -> (weight_packed int32 `[N, K/8]`, weight_scale `[N, K/group_size]`), fused."""
    return quantize_pack_int4_(weight.to(torch.float32, copy=True), group_size, weight.dtype)


_NIBBLE_SIGNS = -0x7F7F7F80  # 0x80808080 as int32: bit 3 of every high nibble


def quantize_pack_int4_(
    x: torch.Tensor, group_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_pack_int4` of a `dtype` weight given as fp32 `x` (exactly representable in dtype); `x` is
    overwritten. Saves the caller's copy when it already holds an fp32 buffer (FP8 dequantization)."""
    rows, cols = x.shape
    groups, weight_scale = _group_scales(x, group_size, dtype)
    _quantize_groups_(groups, weight_scale)
    # Byte k holds q[2k] + 8 in its low nibble, q[2k+1] + 8 in its high one. In fp32 (exact), first
    # `q[2k] + 8 + 16 q[2k+1]`, in [-128, 127], whose int8 byte has `q[2k+1] mod 16` on top; adding 8 to
    # that nibble mod 16 flips its bit 3, for 4 bytes at once in each int32 word.
    pairs = torch.add(x[:, 0::2], x[:, 1::2], alpha=16).add_(8).to(torch.int8)  # [N, K/2]
    weight_packed = pairs.view(torch.int32).reshape(rows, cols // PACK_FACTOR)
    return weight_packed.bitwise_xor_(_NIBBLE_SIGNS), weight_scale.squeeze(-1)
