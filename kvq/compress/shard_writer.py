"""Write one safetensors shard tensor by tensor at precomputed offsets, under a temporary name.

The file's space is reserved up front (a full disk fails before any work), every tensor must be written
exactly once, and a complete, fsynced file is left under its temporary name for the parent process to
rename once the manifest records it (`publish`); on any error the temporary file is removed. Reading of
source tensors (by byte range, no mmap) lives here too: the two edges of a job.
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path
from types import TracebackType

import torch

from kvq.checkpoint.dtypes import SAFETENSORS_DTYPES
from kvq.checkpoint.header import TensorInfo
from kvq.checkpoint.write import tmp_path
from kvq.compress.safetensors_layout import ShardLayout
from kvq.errors import KvqError

COPY_CHUNK_BYTES = 64 * 1024**2
_HASH_CHUNK_BYTES = 16 * 1024**2


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """The stored tensor `info` as a CPU tensor owning its memory (a plain read: no mmap pages held)."""
    data = bytearray(info.nbytes)
    with open(info.file, "rb") as f:
        got = f.readinto(memoryview(data)) if f.seek(info.start) == info.start else 0
    if got != info.nbytes:
        raise KvqError(
            f"{info.file}: tensor {info.name!r} is cut short ({got} of {info.nbytes} bytes readable); "
            "the shard is truncated: re-download it"
        )
    tensor = (
        torch.frombuffer(data, dtype=SAFETENSORS_DTYPES[info.dtype])
        if data
        else torch.empty(0, dtype=SAFETENSORS_DTYPES[info.dtype])
    )
    return tensor.reshape(info.shape)


def publish(path: Path) -> None:
    """Give a shard `commit` finished its final name."""
    os.replace(tmp_path(path), path)


def disk_full_error(path: Path, what: str, e: OSError) -> KvqError:
    return KvqError(
        f"{path}: disk full while {what} ({e.strerror}); free space on {path.parent} or choose "
        "another OUT, then re-run the same command to resume (finished shards are kept)"
    )


class ShardWriter:
    """`with ShardWriter(path, layout) as w: w.write(name, tensor) ...; size, sha256 = w.commit()`; later
    `publish(path)`."""

    def __init__(self, path: Path, layout: ShardLayout) -> None:
        self.path, self.layout = Path(path), layout
        self.tmp = tmp_path(self.path)
        self._remaining = dict(layout.tensors)  # name -> bytes still to write
        self._left = {name: t.nbytes for name, t in layout.tensors.items()}
        self._fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._is_open = True
        try:
            self._reserve(layout.file_bytes)
            self._pwrite(layout.header, 0, "writing the header")
        except BaseException:
            self._abort()
            raise

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._is_open:
            self._abort()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write a whole tensor, which must match the layout's dtype and shape."""
        expected = self._remaining[name]
        found = (SAFETENSORS_DTYPES[expected.dtype], tuple(expected.shape))
        assert (tensor.dtype, tuple(tensor.shape)) == found, (name, tensor.dtype, tuple(tensor.shape), found)
        self.write_bytes(name, 0, tensor_bytes(tensor))

    def write_bytes(self, name: str, offset: int, data: memoryview | bytes) -> None:
        """Write raw bytes of tensor `name` starting `offset` bytes into its data (chunked copies)."""
        self._pwrite(data, self.layout.offsets[name] + offset, f"writing {name!r}")
        self._left[name] -= len(data)
        if self._left[name] == 0:
            del self._remaining[name]

    def commit(self) -> tuple[int, str]:
        """fsync and hash the finished file, still under its temporary name; return (file bytes, sha256 hex).

        The caller renames it with `publish` once it has recorded the shard, so a final name is always a
        shard the manifest knows.
        """
        assert not self._remaining, f"{self.path}: tensors never written: {sorted(self._remaining)[:5]}"
        try:
            os.fsync(self._fd)
        except OSError as e:
            self._abort()
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise disk_full_error(self.path, "flushing", e) from e
            raise
        digest = file_sha256(self._fd)
        os.close(self._fd)
        self._is_open = False
        return self.layout.file_bytes, digest

    def _reserve(self, nbytes: int) -> None:
        """Allocate the whole file now, so a full disk is reported before any work is done."""
        try:
            if nbytes:
                os.posix_fallocate(self._fd, 0, nbytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise disk_full_error(self.path, f"reserving {nbytes} bytes", e) from e
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise

    def _pwrite(self, data: memoryview | bytes, offset: int, what: str) -> None:
        view = memoryview(data).cast("B")
        while view:
            try:
                written = os.pwrite(self._fd, view, offset)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise disk_full_error(self.path, what, e) from e
                raise
            view, offset = view[written:], offset + written

    def _abort(self) -> None:
        if self._is_open:
            os.close(self._fd)
            self._is_open = False
        self.tmp.unlink(missing_ok=True)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor (no copy when already contiguous)."""
    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")  # type: ignore[arg-type]


def file_sha256(fd: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, _HASH_CHUNK_BYTES, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()
