"""The safetensors dtype codes kvq understands and their size in bytes (no torch: headers and plans only).

The matching torch dtypes are in `kvq.checkpoint.torch_dtypes`.
"""

from __future__ import annotations

ITEMSIZES: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
FLOAT_CODES = {"F64", "F32", "F16", "BF16"}
FP8_CODES = {"F8_E4M3", "F8_E5M2"}


def itemsize(code: str) -> int:
    """Bytes per element of a safetensors dtype code."""
    return ITEMSIZES[code]
