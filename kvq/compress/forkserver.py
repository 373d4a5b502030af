"""The compress workers' process context: a forkserver that imports the shard job once.

`kvq compress` starts it (`start_early`) before the command line's own imports, so the server loads on
another core while the parent does; `pool.run_jobs` then forks its workers from it. The shard job needs
no torch (the C quantizer), so workers are ready ~0.1 s after the command starts; a worker imports torch
only if a tensor needs the torch quantizer. Imports nothing heavy itself.
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
