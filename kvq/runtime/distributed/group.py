"""The tensor-parallel group of one engine: rank, size and the few collectives the model and the engine use.

`TpGroup.of(tp)` is this process's place among `tp` ranks (the group of one: every collective the
identity), known before anything is loaded, so a checkpoint that does not split fails on rank 0 before
any other rank starts; `connect` then makes or joins the torch.distributed group: gloo on CPU, NCCL on
CUDA, from a torchrun environment (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT / LOCAL_RANK) when
there is one, else by starting the other ranks (`launch`). Collectives carry a timeout
($KVQ_TP_TIMEOUT seconds): a rank that stops answering ends the step with an error instead of a hang.
Imports torch and kvq.errors only (`launch` when it starts the ranks).
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvq.errors import KvqError

DEFAULT_TIMEOUT_S = 120.0  # one collective; generous for a shared 2-core machine
CONTROL_TIMEOUT = timedelta(days=7)  # ranks past 0 wait this long between steps (an idle server)
STOP = "stop"  # the message that ends the other ranks' loop
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
logger = logging.getLogger("kvq")


def collective_timeout() -> timedelta:
    value = os.environ.get("KVQ_TP_TIMEOUT", str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(value)
    except ValueError as e:
        raise KvqError(f"$KVQ_TP_TIMEOUT is {value!r}; set it to a number of seconds, e.g. 120") from e
    return timedelta(seconds=seconds)


@dataclass
class TpGroup:
    """This process's place among `size` tensor-parallel ranks."""

    rank: int = 0
    size: int = 1
    control: Any = field(default=None, repr=False)  # the group step messages travel in (no short timeout)

    @classmethod
    def single(cls) -> TpGroup:
        return cls()

    @classmethod
    def of(cls, tp: int) -> TpGroup:
        """This process's rank of `tp`: $RANK under a launcher (WORLD_SIZE must equal tp), else 0."""
        world = env_world_size()
        if tp == 1 or world is None:
            return cls(0, tp)
        missing = [name for name in _ENV if name not in os.environ]
        if missing:
            raise KvqError(
                f"--tp {tp} under a launcher (WORLD_SIZE is set), but ${', $'.join(missing)} is not; "
                "run under torchrun, or unset WORLD_SIZE to let kvq start the ranks"
            )
        if world != tp:
            raise KvqError(
                f"--tp {tp} but the launcher started WORLD_SIZE={world} processes; pass --tp {world}"
            )
        return cls(int(os.environ["RANK"]), tp)

    def connect(self, device: torch.device, worker_config: str) -> None:
        """Join the other ranks, starting them first when no launcher did (each builds its engine from
        `worker_config`, the engine config as JSON)."""
        if self.size == 1:
            return
        if env_world_size() is None:
            from kvq.runtime.distributed.launch import start_ranks

            start_ranks(self.size, worker_config)  # sets this process's environment: rank 0
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", self.rank)))
        if not dist.is_initialized():
            timeout = collective_timeout()
            dist.init_process_group(backend, rank=self.rank, world_size=self.size, timeout=timeout)
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        logger.info("tensor parallel: rank %d of %d (%s)", self.rank, self.size, backend)
        if self.is_leader:
            atexit.register(self.close)

    @property
    def is_leader(self) -> bool:
        """Rank 0: runs the scheduler, the KV page bookkeeping and the sampler."""
        return self.rank == 0

    def shard(self, size: int, what: str) -> tuple[int, int]:
        """This rank's [start, stop) of `size` split evenly (`KvqError` naming `what` if it does not)."""
        if size % self.size:
            raise KvqError(
                f"{what}: {size} does not split over {self.size} tensor-parallel ranks; "
                "use a --tp that divides it"
            )
        part = size // self.size
        return self.rank * part, (self.rank + 1) * part

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (partial sums of a row-parallel layer), summed in fp32."""
        if self.size == 1:
            return x
        total = x.float() if x.dtype != torch.float32 else x.clone()
        dist.all_reduce(total)
        return total.to(x.dtype)

    @property
    def all_reduce_or_none(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """`all_reduce`, or None at --tp 1 where there is nothing to sum: what a row-parallel layer holds
        from load on, so that a one-rank step never calls into the group."""
        return None if self.size == 1 else self.all_reduce

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` `[..., n]` concatenated on the last dimension `[..., size * n]`, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV pages every rank can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def gather_ints(self, value: int) -> list[int]:
        """Every rank's `value`, in rank order (each rank's resident weight bytes)."""
        if self.size == 1:
            return [value]
        parts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(parts, torch.tensor([value], dtype=torch.int64), group=self.control)
        return [int(p.item()) for p in parts]

    def gather(self, value: object) -> list[object]:
        """Every rank's `value` on rank 0, in rank order (the other ranks get []), over the control group."""
        if self.size == 1:
            return [value]
        out: list[object] | None = [None] * self.size if self.is_leader else None
        dist.gather_object(value, out, dst=0, group=self.control)
        return out or []

    def close(self) -> None:
        """Rank 0: tell the other ranks to stop, wait for the ones it started and leave the group (at
        exit, or `Engine.close`); once only."""
        from kvq.runtime.distributed.launch import stop_ranks

        if self.size == 1 or not self.is_leader or self.control is None:
            return
        try:
            self.broadcast(STOP)
        except RuntimeError as e:  # a rank is gone already: the watchdog reports it
            logger.warning("tensor parallel: could not stop the other ranks: %s", e)
        stop_ranks()
        dist.destroy_process_group()
        self.control = None
        atexit.unregister(self.close)

    def broadcast(self, message: object) -> object:
        """Rank 0's `message` on every rank (a step's inputs, or a stop), over the control group."""
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


def env_world_size() -> int | None:
    """WORLD_SIZE of a torchrun-compatible environment, None outside one."""
    value = os.environ.get("WORLD_SIZE")
    return None if value is None else int(value)
