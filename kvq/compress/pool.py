"""Run shard jobs in worker processes (forkserver, or spawn), with per-tensor progress and a clean Ctrl-C.

Workers ignore SIGINT; the parent catches it (or any error), terminates the workers and re-raises, so
only complete shards survive under their final names. Each worker gets `cpus // workers` torch threads and
keeps freed heap memory for reuse (a job allocates the same sizes tensor after tensor).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.queues import Queue

import torch

from kvq.compress.forkserver import worker_context
from kvq.compress.shard_job import ShardJob, ShardResult, run_shard_job
from kvq.errors import KvqError

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_DRAIN_TIMEOUT_S = 5.0
_progress_queue: Queue | None = None  # set in each worker by `_init_worker`


def _init_worker(num_threads: int, queue: Queue) -> None:
    global _progress_queue
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(num_threads)
    _progress_queue = queue
    try:  # fresh multi-MB tensors per op otherwise cost page faults that double the quantizer's time
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * 1024**2)
        libc.mallopt(_M_TRIM_THRESHOLD, 1024**3)
        libc.mallopt(_M_TOP_PAD, 64 * 1024**2)
    except OSError:  # not glibc: defaults are fine, only slower
        pass


def _report(nbytes: int) -> None:
    assert _progress_queue is not None
    _progress_queue.put(nbytes)


def _run_in_worker(job: ShardJob) -> ShardResult:
    return run_shard_job(job, _report)


def run_jobs(
    jobs: Sequence[ShardJob],
    workers: int,
    on_done: Callable[[ShardResult], None],
    progress: Callable[[int], None] | None = None,
) -> None:
    """Run every job on `workers` processes; call `on_done` in this process as each finishes."""
    if not jobs:
        return
    ctx = worker_context()
    queue = ctx.Queue()
    drain = threading.Thread(target=_drain, args=(queue, progress), daemon=True)
    drain.start()
    threads = max(1, (os.cpu_count() or 1) // workers)
    executor = ProcessPoolExecutor(
        max_workers=workers, mp_context=ctx, initializer=_init_worker, initargs=(threads, queue)
    )
    is_clean = True
    try:
        largest_first = sorted(jobs, key=lambda job: -job.input_bytes)  # shortens the tail of the last jobs
        pending: set[Future] = {executor.submit(_run_in_worker, job) for job in largest_first}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: f.exception() is not None):  # record successes first
                on_done(future.result())
    except BrokenProcessPool as e:
        is_clean = False
        _terminate(executor)
        raise KvqError(
            f"a worker process died ({e}); if the OS killed it for memory, re-run the same command with "
            "fewer --workers to resume (finished shards are kept)"
        ) from e
    except BaseException:
        is_clean = False
        _terminate(executor)
        raise
    finally:
        executor.shutdown(wait=True, cancel_futures=True)
        queue.put(None)
        # A worker terminated mid-`put` can leave half a message in the queue's pipe (or its lock held):
        # the drain thread may then never see the None, so after a stop it gets a bounded wait, and the
        # queue's feeder thread is not waited for at exit.
        drain.join(timeout=None if is_clean else _DRAIN_TIMEOUT_S)
        queue.close()
        if not is_clean:
            queue.cancel_join_thread()


def _drain(queue: Queue, progress: Callable[[int], None] | None) -> None:
    while (nbytes := queue.get()) is not None:
        if progress is not None:
            progress(nbytes)


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
