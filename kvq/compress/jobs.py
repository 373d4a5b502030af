"""The units of work of `kvq compress`, as the parent plans them and the workers run them (no torch).

A `ShardJob` writes one whole output shard; a shard cut into `PartJob`s (see `kvq.compress.parts`) is
finished by its `CommitJob`. `kvq.compress.shard_job.run_work` runs any of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from kvq.compress.safetensors_layout import ShardLayout, shard_layout
from kvq.compress.tensor_plan import TensorTask


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

    @cached_property
    def layout(self) -> ShardLayout:
        return shard_layout([out for task in self.tasks for out in task.outputs])

    def result(self, sha256: str, *, is_resumed: bool = False) -> ShardResult:
        layout = self.layout
        weight_map = dict.fromkeys(layout.tensors, self.shard)
        return ShardResult(self.shard, layout.file_bytes, layout.tensor_bytes, sha256, weight_map, is_resumed)


@dataclass(frozen=True)
class PartJob:
    """Some of a shard's tasks, written at their offsets into the temporary file the parent created.

    Carries only its own tasks and their outputs' offsets (`layout` is the shard's, cut down to them), so
    handing it to a worker costs little."""

    shard: str
    out_path: Path
    tasks: tuple[TensorTask, ...]
    layout: ShardLayout
    group_size: int
    block: tuple[int, int]

    @property
    def input_bytes(self) -> int:
        return sum(t.input_bytes for t in self.tasks)


@dataclass(frozen=True)
class PartDone:
    shard: str


@dataclass(frozen=True)
class CommitJob:
    """fsync and hash a shard every part of which is written."""

    shard: str
    out_path: Path
    input_bytes = 0  # its parts read the shard's input


@dataclass(frozen=True)
class Committed:
    shard: str
    sha256: str


@dataclass(frozen=True)
class ShardResult:
    shard: str
    file_bytes: int
    tensor_bytes: int
    sha256: str
    weight_map: dict[str, str]
    is_resumed: bool = False


Work = ShardJob | PartJob | CommitJob
Outcome = ShardResult | PartDone | Committed
