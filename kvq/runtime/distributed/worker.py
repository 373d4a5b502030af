"""What ranks 1..N-1 run: the engine's model and KV pool built as rank 0 builds them, then each step's
forward as rank 0 broadcasts it, until it says stop. `python -m kvq.runtime.distributed.worker` is the
entry of the ranks kvq starts itself (`launch`); under torchrun the engine enters `serve_steps` directly.
Imports torch and kvq.runtime.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from kvq.errors import KvqError
from kvq.runtime.batch import StepInputs
from kvq.runtime.distributed.group import STOP
from kvq.runtime.integrity.ranks import follow

if TYPE_CHECKING:
    from kvq.runtime.engine import Engine

PARENT_POLL_S = 1.0


def serve_steps(engine: Engine) -> None:
    """Run rank 0's steps on this rank's shard until rank 0 sends the stop: a bare batch (integrity off),
    or a checked pool's message (`integrity.ranks`: this rank's own page checks and guarded writes). Then
    leave the process group: gloo's threads still running at interpreter exit abort the process."""
    runner = engine.runner
    while True:
        message = engine.tp.broadcast(None)
        if isinstance(message, StepInputs):
            runner.forward_local(runner.batch_of(message))
        elif message == STOP:
            dist.destroy_process_group()
            return
        else:
            follow(engine, message)


def _watch_parent() -> None:
    """Leave when the process that started this rank is gone (rank 0 killed: no stop will come)."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def main() -> int:
    from kvq.runtime.config import EngineConfig
    from kvq.runtime.distributed.launch import WORKER_CONFIG_ENV
    from kvq.runtime.engine import Engine

    threading.Thread(target=_watch_parent, name="kvq-tp-parent", daemon=True).start()
    rank = os.environ.get("RANK", "?")
    try:
        Engine(EngineConfig(**json.loads(os.environ[WORKER_CONFIG_ENV])))  # returns after the stop
    except KvqError as e:
        print(f"kvq: error: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
