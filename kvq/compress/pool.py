"""Run shard jobs in worker processes (forkserver, or spawn), with per-tensor progress and a clean Ctrl-C.

The parent hands out work largest first, one item ahead of the workers, and runs what a finished item
returns (a cut shard's commit) before anything still queued. Workers ignore SIGINT; the parent catches it
(or any error), terminates the workers and re-raises, so only complete shards survive under their final
names. Progress goes through shared memory, one slot per item written only by the worker running it (no
queue, no lock: a worker terminated mid-update cannot leave anything half-sent). Where a tensor needs
the torch quantizer, a worker uses `cpus // workers` torch threads and, between tensors, takes up the
threads the parent offers once fewer items than workers remain. Workers keep freed heap memory for
reuse (a job allocates the same sizes tensor after tensor).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from kvq.compress.forkserver import worker_context
from kvq.compress.jobs import Outcome, Work
from kvq.errors import KvqError

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_POLL_S = 0.1  # how often the parent reads the progress slots
_done_bytes: Any = None  # in each worker: the shared per-job progress slots (`RawArray` of int64)
_threads: Any = None  # in each worker: the shared torch thread count to use from the next tensor on


def threads_per_worker(cpus: int, workers: int, unfinished_jobs: int) -> int:
    """The cores split over the jobs that can still run at once."""
    return max(1, cpus // max(1, min(workers, unfinished_jobs)))


def _init_worker(done_bytes: Any, threads: Any) -> None:
    global _done_bytes, _threads
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _done_bytes, _threads = done_bytes, threads
    os.environ["OMP_NUM_THREADS"] = str(threads.value)  # for torch, if a task needs its quantizer
    try:  # torch's fresh multi-MB tensors per op otherwise cost page faults that double its time
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * 1024**2)
        libc.mallopt(_M_TRIM_THRESHOLD, 1024**3)
        libc.mallopt(_M_TOP_PAD, 64 * 1024**2)
    except OSError:  # not glibc: defaults are fine, only slower
        pass


def _run_in_worker(item: Work, slot: int) -> Outcome:
    from kvq.compress.shard_job import run_work

    def after_task(nbytes: int) -> None:
        _done_bytes[slot] += nbytes  # this worker is the slot's only writer
        torch = sys.modules.get("torch")  # loaded only if a task needed the torch quantizer
        if torch is not None and torch.get_num_threads() != _threads.value:
            torch.set_num_threads(_threads.value)

    return run_work(item, after_task if slot >= 0 else None)


def run_jobs(
    work: Sequence[Work],
    workers: int,
    on_result: Callable[[Outcome], Work | None],
    progress: Callable[[int], None] | None = None,
) -> None:
    """Run all `work` on `workers` processes, largest first; call `on_result` in this process as each item
    finishes. What it returns (a shard's `CommitJob`) runs next, before anything still queued."""
    if not work:
        return
    ctx = worker_context()
    cpus = os.cpu_count() or 1
    done_bytes = ctx.RawArray(ctypes.c_int64, len(work))  # one slot per item of `work`
    threads = ctx.RawValue(ctypes.c_int, threads_per_worker(cpus, workers, len(work)))
    executor = ProcessPoolExecutor(
        max_workers=workers, mp_context=ctx, initializer=_init_worker, initargs=(done_bytes, threads)
    )
    queue = deque(sorted(enumerate(work), key=lambda slot_item: -slot_item[1].input_bytes))
    running: set[Future] = set()
    reported = 0
    try:
        while queue or running:
            while queue and len(running) <= workers:  # one queued ahead: a free worker never waits
                slot, item = queue.popleft()
                running.add(executor.submit(_run_in_worker, item, slot))
            done, running = wait(running, timeout=_POLL_S, return_when=FIRST_COMPLETED)
            threads.value = threads_per_worker(cpus, workers, len(running) + len(queue))
            if progress is not None:
                total = sum(done_bytes)
                progress(total - reported)
                reported = total
            for future in sorted(done, key=lambda f: f.exception() is not None):  # record successes first
                follow_up = on_result(future.result())
                if follow_up is not None:
                    queue.appendleft((-1, follow_up))  # reports no progress: its input was counted
    except BrokenProcessPool as e:
        _terminate(executor)
        raise KvqError(
            f"a worker process died ({e}); if the OS killed it for memory, re-run the same command with "
            "fewer --workers to resume (finished shards are kept)"
        ) from e
    except BaseException:
        _terminate(executor)
        raise
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def _terminate(executor: ProcessPoolExecutor) -> None:
    """Stop the workers now: a worker mid-shard leaves only a temporary file, removed by the caller."""
    terminate = getattr(executor, "terminate_workers", None)  # Python 3.14+
    if terminate is not None:
        terminate()
        return
    for process in list((getattr(executor, "_processes", None) or {}).values()):
        process.terminate()
    for process in list((getattr(executor, "_processes", None) or {}).values()):
        process.join(timeout=10)
