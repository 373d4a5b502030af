"""Write one safetensors shard tensor by tensor at precomputed offsets, under a temporary name.

Every tensor must be written exactly once (by one writer, or split over the part writers of several
workers), and a complete, fsynced file is left under its temporary name for the parent process to rename
once the manifest records it (`shard_files.publish`). Reading of source tensors (by byte range, no mmap)
lives here too: the two edges of a job, in bytes (no torch).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

from kvq.checkpoint.header import TensorInfo
from kvq.checkpoint.write import tmp_path
from kvq.compress.safetensors_layout import ShardLayout
from kvq.compress.shard_files import Bytes, commit_shard_file, pwrite_all, reserve_and_write_header
from kvq.errors import KvqError


def read_bytes(info: TensorInfo) -> bytearray:
    """The stored bytes of source tensor `info` (a plain read: no mmap pages held)."""
    data = bytearray(info.nbytes)
    with open(info.file, "rb") as f:
        got = f.readinto(memoryview(data)) if f.seek(info.start) == info.start else 0
    if got != info.nbytes:
        raise KvqError(
            f"{info.file}: tensor {info.name!r} is cut short ({got} of {info.nbytes} bytes readable); "
            "the shard is truncated: re-download it"
        )
    return data


@contextmanager
def mapped(info: TensorInfo) -> Iterator[memoryview]:
    """Source tensor `info`'s bytes, memory-mapped read-only for the `with` block (no copy; its pages are
    resident only while mapped). Planning checked that every tensor lies inside its file."""
    start = info.start - info.start % mmap.ALLOCATIONGRANULARITY
    with (
        open(info.file, "rb") as f,
        mmap.mmap(f.fileno(), info.end - start, offset=start, access=mmap.ACCESS_READ) as m,
    ):
        view = memoryview(m)[info.start - start : info.end]
        try:
            yield view
        finally:
            view.release()


class ShardWriter:
    """Writes tensors of one shard at their layout offsets, into its temporary file.

    Whole shard: `with ShardWriter.create(path, layout) as w: w.write(name, tensor) ...; size, sha256 =
    w.commit()`, later `publish(path)`. Part of a shard (several workers, one file): the parent runs
    `create_shard_file(path, layout)`, each part does `with ShardWriter.part(path, layout, names) as w: ...;
    w.close()`, and once every part is done `commit_shard_file(path)`. A whole-shard writer removes its
    file on error; a part leaves that to its parent.
    """

    def __init__(self, path: Path, layout: ShardLayout, names: Collection[str], *, owns_file: bool) -> None:
        self.path, self.layout = Path(path), layout
        self.tmp = tmp_path(self.path)
        self._remaining = {name: layout.tensors[name] for name in names}  # name -> tensor still to write
        self._left = {name: t.nbytes for name, t in self._remaining.items()}
        self._owns_file = owns_file
        self._fd = os.open(self.tmp, os.O_RDWR | (os.O_CREAT | os.O_TRUNC if owns_file else 0), 0o644)
        self._is_open = True
        if owns_file:
            try:
                reserve_and_write_header(self._fd, self.path, layout)
            except BaseException:
                self._abort()
                raise

    @classmethod
    def create(cls, path: Path, layout: ShardLayout) -> ShardWriter:
        """Create the whole shard's temporary file (space reserved, header written) to write every tensor."""
        return cls(path, layout, layout.tensors, owns_file=True)

    @classmethod
    def part(cls, path: Path, layout: ShardLayout, names: Collection[str]) -> ShardWriter:
        """Open the temporary file `create_shard_file` made, to write the tensors `names` of it."""
        return cls(path, layout, names, owns_file=False)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._is_open:
            self._abort()

    def write(self, name: str, data: Bytes) -> None:
        """Write all bytes of tensor `name` (exactly its size in the layout)."""
        assert memoryview(data).nbytes == self._remaining[name].nbytes, (name, memoryview(data).nbytes)
        self.write_bytes(name, 0, data)

    def write_bytes(self, name: str, offset: int, data: Bytes) -> None:
        """Write raw bytes of tensor `name` starting `offset` bytes into its data (chunked copies)."""
        pwrite_all(self._fd, data, self.layout.offsets[name] + offset, self.path, f"writing {name!r}")
        self._left[name] -= len(data)
        if self._left[name] == 0:
            del self._remaining[name]

    def close(self) -> None:
        """Done writing (every tensor this writer was given must have been written); no fsync."""
        assert not self._remaining, f"{self.path}: tensors never written: {sorted(self._remaining)[:5]}"
        os.close(self._fd)
        self._is_open = False

    def commit(self) -> tuple[int, str]:
        """Close, fsync and hash the finished whole shard, still under its temporary name; return (file
        bytes, sha256 hex). The caller renames it with `publish` once it has recorded the shard, so a final
        name is always a shard the manifest knows."""
        self.close()
        try:
            return self.layout.file_bytes, commit_shard_file(self.path)
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise

    def _abort(self) -> None:
        if self._is_open:
            os.close(self._fd)
            self._is_open = False
        if self._owns_file:
            self.tmp.unlink(missing_ok=True)
