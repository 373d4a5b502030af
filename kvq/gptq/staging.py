"""GPTQ's per-layer results on disk, under `OUT/.kvq-gptq/`, until the output shards are written.

Per finished decoder layer: `layer-{i}.safetensors` (the `weight_packed` / `weight_scale` /
`weight_shape` of its GPTQ'd modules) and `state-{i}.safetensors` (every sample's hidden states after
it, and DSA's top-k picks; GPTAQ's full-precision ones too, as `fp.hidden.{s}` / `fp.topk.{s}`), each
written through the shard writer (temporary name, fsync, sha256, rename) and recorded in the manifest
only once complete. A killed run thus restarts at the first layer not recorded, from the recorded
state, and ends byte-identical. The output shards then take the staged tensors as plain byte copies
(`staged_jobs`), in the layout round-to-nearest would write.
Imports torch and kvq.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import torch

from kvq.calibrate.layer_stream import StreamState
from kvq.checkpoint.header import ShardHeader, read_header
from kvq.checkpoint.torch_dtypes import TORCH_TO_SAFETENSORS
from kvq.compress.jobs import ShardJob
from kvq.compress.safetensors_layout import shard_layout
from kvq.compress.shard_files import file_sha256, publish
from kvq.compress.shard_writer import ShardWriter
from kvq.compress.tensor_plan import COPY, INT4, OutputTensor, TensorTask
from kvq.compress.torch_quantize import read_tensor, tensor_bytes

STAGING_DIR = ".kvq-gptq"


def layer_path(out: Path, layer_idx: int) -> Path:
    return out / STAGING_DIR / f"layer-{layer_idx:05d}.safetensors"


def state_path(out: Path, layer_idx: int) -> Path:
    return out / STAGING_DIR / f"state-{layer_idx:05d}.safetensors"


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict:
    """Write `tensors` as a safetensors file (no second copy in memory); return its manifest record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    outputs = [OutputTensor(n, TORCH_TO_SAFETENSORS[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    with ShardWriter.create(path, shard_layout(outputs)) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor_bytes(tensor))
        nbytes, sha256 = writer.commit()
    publish(path)
    return {"bytes": nbytes, "sha256": sha256}


def is_intact(path: Path, record: dict) -> bool:
    """Whether `path` is the file `record` describes (size, then sha256)."""
    if not path.is_file() or path.stat().st_size != record.get("bytes"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        return file_sha256(fd) == record.get("sha256")
    finally:
        os.close(fd)


def save_state(out: Path, layer_idx: int, state: StreamState, fp_state: StreamState | None = None) -> dict:
    tensors: dict[str, torch.Tensor] = {}
    for prefix, st in (("", state), ("fp.", fp_state)):
        if st is not None:
            tensors |= {f"{prefix}hidden.{s}": h for s, h in enumerate(st.hidden)}
            tensors |= {f"{prefix}topk.{s}": t for s, t in enumerate(st.topk) if t is not None}
    return write_tensors(state_path(out, layer_idx), tensors)


def load_state(
    out: Path, layer_idx: int, num_samples: int, fp: bool = False
) -> tuple[StreamState, StreamState | None]:
    """The carried states after layer `layer_idx` (and GPTAQ's full-precision ones when `fp`)."""
    header = read_header(state_path(out, layer_idx))

    def states(prefix: str) -> StreamState:
        hidden = [read_tensor(header.tensors[f"{prefix}hidden.{s}"]) for s in range(num_samples)]
        topk = [header.tensors.get(f"{prefix}topk.{s}") for s in range(num_samples)]
        return StreamState(hidden, [None if info is None else read_tensor(info) for info in topk])

    return states(""), states("fp.") if fp else None


def drop_states_before(out: Path, layer_idx: int) -> None:
    """Remove the hidden states of layers before `layer_idx` (only the last one is ever resumed from)."""
    for path in (out / STAGING_DIR).glob("state-*.safetensors"):
        if int(path.stem.removeprefix("state-")) < layer_idx:
            path.unlink()


def remove_staging(out: Path) -> None:
    shutil.rmtree(out / STAGING_DIR, ignore_errors=True)


def staged_jobs(jobs: list[ShardJob], staged: dict[str, ShardHeader]) -> list[ShardJob]:
    """`jobs` with every INT4 task of a GPTQ'd module (`staged`: module -> its layer file) turned into
    byte copies of the staged tensors: same outputs, so the same shard layout."""
    return [
        dataclasses.replace(job, tasks=tuple(t for task in job.tasks for t in _copies(task, staged)))
        for job in jobs
    ]


def _copies(task: TensorTask, staged: dict[str, ShardHeader]) -> list[TensorTask]:
    header = staged.get(task.module) if task.action == INT4 else None
    if header is None:
        return [task]
    copies = []
    for out in task.outputs:
        info = header.tensors[out.name]
        assert (info.dtype, info.shape) == (out.dtype, out.shape), (out, info)
        copies.append(TensorTask(COPY, info, None, (OutputTensor(out.name, out.dtype, out.shape),)))
    return copies
