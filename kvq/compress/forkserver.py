"""The compress workers' process context: a forkserver that imports torch and the shard job once.

`kvq compress` starts it (`start_early`) before the command line's own imports, so the server imports
torch on another core while the parent does (about 1.2 s of wall time on a 2-core box); `pool.run_jobs`
then forks its workers from the same server. Imports nothing heavy itself.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.context import BaseContext

PRELOAD = ["kvq.compress.shard_job"]


def worker_context() -> BaseContext:
    """forkserver (workers fork from a server that has imported torch) where the OS has it, else spawn."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return mp.get_context("spawn")


def start_early() -> None:
    """Start the forkserver now, in the background; a no-op where workers are spawned."""
    if worker_context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()
