"""Shard jobs, run in worker processes: read the tensors a shard needs, transform them, write the shard.

`run_shard_job(job) -> ShardResult` is a pure function of its job (same job, same bytes). Memory stays
at one tensor's working set: tensors are read one at a time (a `weight_scale_inv` from whichever shard
holds it), copies stream in 64 MiB chunks, and outputs go straight to their offsets in the shard file.
A shard can also be done as `PartJob`s on several workers (into the file the parent created), then a
`CommitJob` that fsyncs and hashes it: `run_work` runs any of the three. Tensors go through the C
quantizer (`native`) where it applies, else through `torch_quantize`; this module itself needs no torch,
so the workers start without importing it (an FP8 weight written as BF16 goes through torch). Every
tensor is checked for NaN/Inf as it is read, copies included.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from kvq.checkpoint.dtypes import itemsize
from kvq.checkpoint.header import TensorInfo
from kvq.compress import native
from kvq.compress.jobs import (
    CommitJob,
    Committed,
    Outcome,
    PartDone,
    PartJob,
    ShardJob,
    ShardResult,
    Work,
)
from kvq.compress.shard_files import COPY_CHUNK_BYTES, Bytes, commit_shard_file, file_sha256
from kvq.compress.shard_writer import ShardWriter
from kvq.compress.tensor_plan import COPY, DEQUANTIZE, FP8_BLOCK, INT4, TensorTask
from kvq.errors import KvqError
from kvq.formats.nonfinite import first_nonfinite

Progress = Callable[[int], None]


def run_work(item: Work, progress: Progress | None = None) -> Outcome:
    """Run one unit of work in this process."""
    if isinstance(item, PartJob):
        run_part_job(item, progress)
        return PartDone(item.shard)
    if isinstance(item, CommitJob):
        return Committed(item.shard, commit_shard_file(item.out_path))
    return run_shard_job(item, progress)


def run_shard_job(job: ShardJob, progress: Progress | None = None) -> ShardResult:
    """Write `job.out_path` (via a temporary name) and describe it; raise `KvqError` naming a bad tensor.

    A shard an earlier run finished (same size and sha256 as recorded) is kept as it is.
    """
    if job.recorded is not None and _is_finished(job.out_path, job.recorded):
        if progress is not None:
            progress(job.input_bytes)
        return job.result(job.recorded[1], is_resumed=True)
    with ShardWriter.create(job.out_path, job.layout) as writer:
        _write_tasks(job.tasks, writer, job.group_size, job.block, progress)
        file_bytes, sha256 = writer.commit()
    assert file_bytes == job.layout.file_bytes
    return job.result(sha256)


def run_part_job(part: PartJob, progress: Progress | None = None) -> None:
    """Write the tensors of one part into the shard's temporary file (no fsync: the `CommitJob` does)."""
    with ShardWriter.part(part.out_path, part.layout, part.layout.tensors) as writer:
        _write_tasks(part.tasks, writer, part.group_size, part.block, progress)
        writer.close()


def _write_tasks(
    tasks: Sequence[TensorTask],
    writer: ShardWriter,
    group_size: int,
    block: tuple[int, int],
    progress: Progress | None,
) -> None:
    for task in tasks:
        if task.action == COPY:
            _copy(task.source, writer)
        elif task.action == INT4:
            _quantize(task, writer, group_size, block)
        elif task.action == DEQUANTIZE:
            from kvq.compress import torch_quantize

            writer.write(task.outputs[0].name, torch_quantize.dequantize_task(task, block))
        else:
            assert task.action == FP8_BLOCK, task.action
            _keep_fp8(task, writer)
        if progress is not None:
            progress(task.input_bytes)


def _is_finished(path: Path, recorded: tuple[int, str]) -> bool:
    nbytes, sha256 = recorded
    if not path.is_file() or path.stat().st_size != nbytes:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        return file_sha256(fd) == sha256
    finally:
        os.close(fd)


def _copy(info: TensorInfo, writer: ShardWriter) -> None:
    fd = os.open(info.file, os.O_RDONLY)
    try:
        for offset in range(0, info.nbytes, COPY_CHUNK_BYTES):
            want = min(COPY_CHUNK_BYTES, info.nbytes - offset)
            chunk = os.pread(fd, want, info.start + offset)
            if len(chunk) != want:
                raise KvqError(
                    f"{info.file}: tensor {info.name!r} is cut short at byte "
                    f"{info.start + offset + len(chunk)}"
                    "; the shard is truncated: re-download it"
                )
            _check_finite(info, offset, chunk)
            writer.write_bytes(info.name, offset, chunk)
    finally:
        os.close(fd)


def _check_finite(info: TensorInfo, offset: int, chunk: bytes) -> None:
    """A NaN/Inf in a tensor kept as it is (a norm, an embedding, a Linear left at BF16) stops the run too."""
    first = first_nonfinite(chunk, info.dtype)
    if first is None:
        return
    flat = offset // itemsize(info.dtype) + first
    position = []
    for size in reversed(info.shape or (1,)):
        flat, index = divmod(flat, size)
        position.append(index)
    raise KvqError(
        f"{info.file}: tensor {info.name!r} holds NaN/Inf (first at {position[::-1]}); the source "
        f"checkpoint is corrupt: re-download {info.file.name}"
    )


def _quantize(task: TensorTask, writer: ShardWriter, group_size: int, block: tuple[int, int]) -> None:
    packed_out, scale_out, shape_out = task.outputs
    outputs: tuple[Bytes, Bytes] | None = native.quantize_task(task, group_size, block)
    if outputs is None:
        from kvq.compress import torch_quantize

        outputs = torch_quantize.quantize_task(task, group_size, block)
    writer.write(packed_out.name, outputs[0])
    writer.write(scale_out.name, outputs[1])
    writer.write(shape_out.name, native.weight_shape_bytes(task.source.shape))


def _keep_fp8(task: TensorTask, writer: ShardWriter) -> None:
    weight_out, scale_out = task.outputs
    outputs: tuple[Bytes, Bytes] | None = native.keep_fp8_task(task)
    if outputs is None:
        from kvq.compress import torch_quantize

        outputs = torch_quantize.keep_fp8_task(task)
    writer.write(weight_out.name, outputs[0])
    writer.write(scale_out.name, outputs[1])
