"""Parse and validate one safetensors file's header without reading tensor data.

Layout: 8-byte little-endian header length N, N bytes of JSON `{name: {dtype, shape, data_offsets}}`,
then the data. Every check that can be made from the header and the file size is made here, so a
truncated or corrupted shard is reported by name before any job starts.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

from kvq.checkpoint.dtypes import ITEMSIZES, itemsize
from kvq.errors import KvqError

MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its shard, dtype code, shape and absolute byte range in the file."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ShardHeader:
    """A parsed safetensors header: the tensors of one file, its metadata and its sizes."""

    file: Path
    header_bytes: int  # 8 + JSON length
    file_bytes: int
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_bytes(self) -> int:
        return self.file_bytes - self.header_bytes


def _bad(path: Path, problem: str) -> KvqError:
    return KvqError(f"{path}: {problem}; the file is truncated or corrupt, re-download or re-create it")


def read_header(path: Path) -> ShardHeader:
    """Read and validate the header of a safetensors file; raise `KvqError` naming the file if it is bad."""
    path = Path(path)
    try:
        file_bytes = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _bad(path, f"file is {file_bytes} bytes, too short for a safetensors header")
            (json_len,) = struct.unpack("<Q", prefix)
            if json_len > MAX_HEADER_BYTES or 8 + json_len > file_bytes:
                raise _bad(path, f"header length {json_len} does not fit in a file of {file_bytes} bytes")
            raw = f.read(json_len)
    except OSError as e:
        raise KvqError(f"{path}: cannot read ({e.strerror}); check the path and permissions") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(path, f"header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    header_bytes = 8 + json_len
    data_bytes = file_bytes - header_bytes
    tensors = {
        name: _tensor_info(path, name, entry, header_bytes, data_bytes) for name, entry in header.items()
    }
    return ShardHeader(path, header_bytes, file_bytes, tensors, metadata)


def _tensor_info(path: Path, name: str, entry: object, header_bytes: int, data_bytes: int) -> TensorInfo:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise _bad(path, f"tensor {name!r} has a malformed header entry {entry!r}")
    dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    if dtype not in ITEMSIZES:
        raise KvqError(
            f"{path}: tensor {name!r} has dtype {dtype}, which kvq does not read "
            f"(supported: {', '.join(ITEMSIZES)})"
        )
    if not 0 <= begin <= end:
        raise _bad(path, f"tensor {name!r} has invalid data_offsets [{begin}, {end}]")
    if end > data_bytes:
        raise _bad(
            path, f"tensor {name!r} ends at byte {end} but the file holds only {data_bytes} data bytes"
        )
    if (end - begin) != math.prod(shape) * itemsize(dtype):
        raise _bad(
            path,
            f"tensor {name!r} spans {end - begin} bytes, but {dtype}{list(shape)} needs "
            f"{math.prod(shape) * itemsize(dtype)}",
        )
    return TensorInfo(name, path, dtype, shape, header_bytes + begin, header_bytes + end)
