"""One shard job, run in a worker process: read the tensors it needs, transform them, write the output shard.

`run_shard_job(job) -> ShardResult` is a pure function of its job (same job, same bytes). Memory stays
at one tensor's working set: tensors are read one at a time (a `weight_scale_inv` from whichever shard
holds it), copies stream in 64 MiB chunks, and outputs go straight to their offsets in the shard file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvq.checkpoint.header import TensorInfo
from kvq.compress.fp8_decode import decode_fp8_block, first_nan, fp8_bits, has_nan
from kvq.compress.safetensors_layout import shard_layout
from kvq.compress.shard_writer import COPY_CHUNK_BYTES, ShardWriter, file_sha256, read_tensor
from kvq.compress.tensor_plan import COPY, FP8_BLOCK, INT4, TensorTask
from kvq.errors import KvqError
from kvq.formats.pack_quantized import PACK_FACTOR, quantize_pack_int4_

Progress = Callable[[int], None]
CHUNK_ELEMENTS = 1 << 20  # 4 MiB of fp32 per pass: fits the L2/L3 caches of a server core


@dataclass(frozen=True)
class ShardJob:
    """Everything one worker needs: the output file and the tasks whose outputs it holds."""

    shard: str
    out_path: Path
    tasks: tuple[TensorTask, ...]
    group_size: int
    block: tuple[int, int]
    recorded: tuple[int, str] | None = None  # (bytes, sha256) of this shard from an earlier run's manifest

    @property
    def input_bytes(self) -> int:
        return sum(t.input_bytes for t in self.tasks)


@dataclass(frozen=True)
class ShardResult:
    shard: str
    file_bytes: int
    tensor_bytes: int
    sha256: str
    weight_map: dict[str, str]
    is_resumed: bool = False


def run_shard_job(job: ShardJob, progress: Progress | None = None) -> ShardResult:
    """Write `job.out_path` (via a temporary name) and describe it; raise `KvqError` naming a bad tensor.

    A shard an earlier run finished (same size and sha256 as recorded) is kept as it is.
    """
    layout = shard_layout([out for task in job.tasks for out in task.outputs])
    weight_map = dict.fromkeys(layout.tensors, job.shard)
    if job.recorded is not None and _is_finished(job.out_path, job.recorded):
        if progress is not None:
            progress(job.input_bytes)
        nbytes, sha256 = job.recorded
        return ShardResult(job.shard, nbytes, layout.tensor_bytes, sha256, weight_map, is_resumed=True)
    with ShardWriter(job.out_path, layout) as writer:
        for task in job.tasks:
            if task.action == COPY:
                _copy(task.source, writer)
            elif task.action == INT4:
                _quantize(task, writer, job.group_size, job.block)
            else:
                assert task.action == FP8_BLOCK, task.action
                _keep_fp8(task, writer)
            if progress is not None:
                progress(task.input_bytes)
        file_bytes, sha256 = writer.commit()
    return ShardResult(job.shard, file_bytes, layout.tensor_bytes, sha256, weight_map)


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
            writer.write_bytes(info.name, offset, chunk)
    finally:
        os.close(fd)


def _quantize(task: TensorTask, writer: ShardWriter, group_size: int, block: tuple[int, int]) -> None:
    packed_out, scale_out, shape_out = task.outputs
    weight = read_tensor(task.source)
    scale_inv = None
    if task.scale_inv is not None:
        _check_fp8(task.source, weight)
        scale_inv = _read_scale_inv(task.scale_inv)
    weight_packed, weight_scale = quantize_rows(weight, scale_inv, group_size, block)
    if not bool(torch.isfinite(weight_scale).all()):  # absmax propagates NaN and Inf from any group member
        _raise_non_finite(task, block)
    writer.write(packed_out.name, weight_packed)
    writer.write(scale_out.name, weight_scale)
    writer.write(shape_out.name, torch.tensor(task.source.shape, dtype=torch.int64))


def quantize_rows(
    weight: torch.Tensor, scale_inv: torch.Tensor | None, group_size: int, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A BF16/FP16/FP32 weight, or an FP8 one with its block `scale_inv`, -> (weight_packed, weight_scale).

    Works through about `CHUNK_ELEMENTS` at a time (whole FP8 block rows), so the ~10 elementwise passes
    stay in the CPU cache: 4x faster than whole-tensor passes on GLM-5's 2048 x 7168 experts.
    """
    rows, cols = weight.shape
    dtype = torch.bfloat16 if scale_inv is not None else weight.dtype
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    if scale_inv is not None:
        step = max(block[0], step // block[0] * block[0])
    weight_packed = torch.empty(rows, cols // PACK_FACTOR, dtype=torch.int32)
    weight_scale = torch.empty(rows, cols // group_size, dtype=dtype)
    for r in range(0, rows, step):
        part = weight[r : r + step]
        if scale_inv is None:
            x = part.to(torch.float32, copy=True)
        else:
            # as compressed-tensors' FP8BlockDequantizer: the fp32 product, rounded to bf16, is quantized
            block_rows = scale_inv[r // block[0] : -(-(r + step) // block[0])]
            x = decode_fp8_block(fp8_bits(part), block_rows, block)
            x.copy_(x.to(torch.bfloat16))
        weight_packed[r : r + step], weight_scale[r : r + step] = quantize_pack_int4_(x, group_size, dtype)
    return weight_packed, weight_scale


def _keep_fp8(task: TensorTask, writer: ShardWriter) -> None:
    weight_out, scale_out = task.outputs
    weight = read_tensor(task.source)
    _check_fp8(task.source, weight)
    assert task.scale_inv is not None
    writer.write(weight_out.name, weight)
    writer.write(scale_out.name, _read_scale_inv(task.scale_inv))


def _read_scale_inv(info: TensorInfo) -> torch.Tensor:
    scale = read_tensor(info).to(torch.float32)
    if not bool(torch.isfinite(scale).all()):
        bad = [int(i) for i in torch.nonzero(~torch.isfinite(scale))[0]]
        raise KvqError(
            f"{info.file}: tensor {info.name!r} holds NaN/Inf (first at block {bad}); the source "
            f"checkpoint is corrupt: re-download {info.file.name}"
        )
    return scale


def _check_fp8(info: TensorInfo, weight: torch.Tensor) -> None:
    if has_nan(weight):
        raise KvqError(
            f"{info.file}: FP8 tensor {info.name!r} holds NaN (first at [row, column] "
            f"{list(first_nan(weight))}); the source checkpoint is corrupt: re-download {info.file.name}"
        )


def _raise_non_finite(task: TensorTask, block: tuple[int, int]) -> None:
    info = task.source
    dense = read_tensor(info)
    if task.scale_inv is not None:
        dense = decode_fp8_block(fp8_bits(dense), read_tensor(task.scale_inv), block)
    bad = [int(i) for i in torch.nonzero(~torch.isfinite(dense.float()))[0]]
    after = " after FP8 dequantization" if task.scale_inv is not None else ""
    raise KvqError(
        f"{info.file}: tensor {info.name!r} holds NaN/Inf (first at [row, column] {bad}{after}); it cannot "
        f"be quantized: the source checkpoint is corrupt, re-download {info.file.name}"
    )
