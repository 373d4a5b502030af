"""The shapes and constants of the stored formats, without torch (plans and headers use only these).

The tensor functions over them are in `kvq.formats.pack_quantized` and `kvq.formats.fp8_block`.
"""

from __future__ import annotations

PACK_FACTOR = 8  # int4 values per int32 word of `weight_packed`
GROUP_SIZES = (32, 64, 128)  # the group sizes kvq's recipes accept
DEFAULT_BLOCK = (128, 128)  # FP8-block `weight_scale_inv` block, when config.json does not say


def scale_inv_shape(weight_shape: tuple[int, ...], block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, int]:
    """Shape of `weight_scale_inv` for a 2-D weight: one scale per (partial) block."""
    rows, cols = weight_shape
    return (-(-rows // block[0]), -(-cols // block[1]))
