"""The C quantizer (`kvq.compress._int4`, built with the package) applied to one task's bytes, no torch.

It takes FP8-block sources with fp32 `weight_scale_inv` and BF16 sources, the two formats frontier
checkpoints ship, and gives bytes identical to `torch_quantize` (tests/compress/test_native.py), about
2x faster on one core and without the ~1 s torch import in every worker. Anything else, or a build
without the extension (no C compiler at install time), returns None and the caller uses `torch_quantize`.
A corrupt tensor is handed to `torch_quantize.raise_non_finite`, which names its first bad element.
"""

from __future__ import annotations

import importlib
import math
import struct
from types import ModuleType

from kvq.checkpoint.header import TensorInfo
from kvq.compress.shard_writer import mapped, read_bytes
from kvq.compress.tensor_plan import TensorTask

_int4: ModuleType | None
try:
    _int4 = importlib.import_module("kvq.compress._int4")
except ImportError:  # built without a C compiler
    _int4 = None

_KINDS = {"F8_E4M3": 0, "BF16": 1}
_MAX_GROUP = 1024


def is_available() -> bool:
    return _int4 is not None


def quantize_task(
    task: TensorTask, group_size: int, block: tuple[int, int]
) -> tuple[bytearray, bytearray] | None:
    """An INT4 task's (weight_packed, weight_scale) bytes, or None where the C quantizer does not apply."""
    info = task.source
    kind = _KINDS.get(info.dtype)
    fp8 = task.scale_inv is not None
    if _int4 is None or kind is None or (kind == 0) != fp8 or group_size > _MAX_GROUP:
        return None
    scale_inv = b""
    if task.scale_inv is not None:
        scale = read_scale_inv(task.scale_inv)
        if scale is None:
            return None
        scale_inv = scale
    rows, cols = info.shape
    weight_packed, weight_scale = bytearray(rows * cols // 2), bytearray(rows * cols // group_size * 2)
    with mapped(info) as weight:
        status = _int4.quantize(
            kind, weight, scale_inv, rows, cols, group_size, *block, weight_packed, weight_scale
        )
    if status:  # a NaN/Inf scale: find and name the bad element
        from kvq.compress.torch_quantize import raise_non_finite

        raise_non_finite(task, block)
    return weight_packed, weight_scale


def keep_fp8_task(task: TensorTask) -> tuple[bytearray, bytes] | None:
    """An FP8-block task's (weight, fp32 weight_scale) bytes, checked; None if its scale is not fp32."""
    assert task.scale_inv is not None
    scale = read_scale_inv(task.scale_inv)
    if scale is None:
        return None
    weight = read_bytes(task.source)
    if b"\x7f" in weight or b"\xff" in weight:  # e4m3fn NaN is S.1111.111: name it
        from kvq.compress.torch_quantize import keep_fp8_task as checked

        checked(task)
    return weight, scale


def read_scale_inv(info: TensorInfo) -> bytes | None:
    """An fp32 `weight_scale_inv`'s bytes, checked finite; None if it is stored in another dtype."""
    if info.dtype != "F32":
        return None
    data = bytes(read_bytes(info))
    values = memoryview(data).cast("f")
    if not all(map(math.isfinite, values)):
        from kvq.compress.torch_quantize import scale_inv_error

        first = next(i for i, v in enumerate(values) if not math.isfinite(v))
        cols = info.shape[1] if len(info.shape) == 2 else 1
        raise scale_inv_error(info, [first // cols, first % cols])
    return data


def weight_shape_bytes(shape: tuple[int, ...]) -> bytes:
    """`weight_shape` (int64 [2]) as stored."""
    return struct.pack(f"<{len(shape)}q", *shape)
