"""What ranks 1..N-1 that kvq starts itself (`launch`) run: `python -m kvq.runtime.distributed.worker` builds
this rank's `ModelRunner` (its shard of the model and its KV pool, as rank 0 builds its own) and runs its
`loop()` until rank 0 says stop. Under torchrun every rank runs the command: the command hands a rank past 0
to `follow_under_launcher`, which runs the same loop and ends the process. Imports kvq.runtime.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

from kvq.errors import KvqError

if TYPE_CHECKING:
    from kvq.runtime.config import EngineConfig

PARENT_POLL_S = 1.0


def _watch_parent() -> None:
    """Leave when the process that started this rank is gone (rank 0 killed: no stop will come)."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def main() -> int:
    from kvq.runtime.config import EngineConfig
    from kvq.runtime.distributed.launch import WORKER_CONFIG_ENV
    from kvq.runtime.model_runner import ModelRunner

    threading.Thread(target=_watch_parent, name="kvq-tp-parent", daemon=True).start()
    rank = os.environ.get("RANK", "?")
    try:
        ModelRunner(EngineConfig(**json.loads(os.environ[WORKER_CONFIG_ENV]))).loop()  # until rank 0's stop
    except KvqError as e:
        print(f"kvq: error: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


def follow_under_launcher(config: EngineConfig) -> None:
    """Under torchrun every rank runs the command: on a rank past 0 run rank 0's steps (this rank's
    `ModelRunner.loop()`) and end the process with status 0, so the command's own work (its text, its
    server) runs once, on rank 0. Returns at once on rank 0 and outside a launcher."""
    from kvq.runtime.distributed.group import TpGroup
    from kvq.runtime.model_runner import ModelRunner

    if TpGroup.of(config.tp).is_leader:
        return
    ModelRunner(config).loop()  # until rank 0's stop
    raise SystemExit(0)


if __name__ == "__main__":
    sys.exit(main())
