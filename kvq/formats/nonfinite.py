"""Where a float tensor's raw little-endian bytes hold a NaN or an infinity, without torch: an element
whose exponent bits are all ones (e4m3fn, which has no infinities: S.1111.111), that is, whose bits less
the sign are at least that mask. Lets `kvq compress` check every tensor it copies as it copies it, on
bytes already read (one pass and a max: ~10 ms per 64 MiB). Imports numpy (lazily) only.
"""

from __future__ import annotations

# safetensors dtype code -> (unsigned int of its width, all bits but the sign, the NaN/Inf exponent mask)
_EXPONENT_MASKS = {
    "F64": ("<u8", 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
    "F32": ("<u4", 0x7FFFFFFF, 0x7F800000),
    "F16": ("<u2", 0x7FFF, 0x7C00),
    "BF16": ("<u2", 0x7FFF, 0x7F80),
    "F8_E5M2": ("u1", 0x7F, 0x7C),
    "F8_E4M3": ("u1", 0x7F, 0x7F),
}


def first_nonfinite(data: bytes | bytearray | memoryview, dtype: str) -> int | None:
    """The index (in elements) of the first NaN/Inf in `data` of safetensors dtype `dtype`; None if there
    is none or the dtype is not a float."""
    if dtype not in _EXPONENT_MASKS:
        return None
    import numpy as np

    kind, magnitude, exponent = _EXPONENT_MASKS[dtype]
    bits = np.frombuffer(data, dtype=np.dtype(kind))
    if not bits.size:
        return None
    magnitudes = np.bitwise_and(bits, magnitude)
    if magnitudes.max() < exponent:
        return None
    return int((magnitudes >= exponent).argmax())
