"""The ranks kvq starts itself for `--tp N` outside torchrun (as vLLM does): N - 1 processes on this host,
each running `kvq.runtime.distributed.worker`, and a watchdog thread that ends rank 0 with an error
naming the rank when one of them dies. Imports the standard library and kvq.errors only.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

from kvq.errors import KvqError

WORKER_CONFIG_ENV = "KVQ_TP_WORKER_CONFIG"  # the engine config (JSON) the workers build from
POLL_S = 0.2
GRACE_S = 2.0  # after a rank dies, time for rank 0's own error (the same bad input) to be printed
STOP_WAIT_S = 30.0
_SET_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_ranks: list[subprocess.Popen] = []
_stopping = [threading.Event()]  # the current launch's: set when its ranks are told to stop


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(tp: int, worker_config: str) -> None:
    """Start ranks 1..tp-1 and make this process rank 0 (its torchrun-style environment)."""
    if _ranks:
        raise KvqError("this process started tensor-parallel ranks already: one --tp engine per process")
    env = {
        **os.environ,
        "WORLD_SIZE": str(tp),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        WORKER_CONFIG_ENV: worker_config,
    }
    for rank in range(1, tp):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        cmd = [sys.executable, "-m", "kvq.runtime.distributed.worker"]
        _ranks.append(
            subprocess.Popen(cmd, env=rank_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        )
    os.environ.update({k: env[k] for k in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")})
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0"})
    _stopping[0] = stopping = threading.Event()
    watch = threading.Thread(
        target=_watch, args=(list(_ranks), stopping), name="kvq-tp-watchdog", daemon=True
    )
    watch.start()


def rank_pids() -> list[int]:
    """Process ids of the ranks this process started (rank 1 first)."""
    return [p.pid for p in _ranks]


def _watch(ranks: list[subprocess.Popen], stopping: threading.Event) -> None:
    """End this process (exit code 1) soon after any rank it started exits while it still runs."""
    while not stopping.is_set():
        for rank, proc in enumerate(ranks, start=1):
            code = proc.poll()
            if code is not None and not stopping.is_set():
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                print(
                    f"kvq: error: tensor-parallel rank {rank} (pid {proc.pid}) {how}; stopping all ranks",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(GRACE_S)
                _kill_all()
                os._exit(1)
        time.sleep(POLL_S)


def _kill_all() -> None:
    for proc in _ranks:
        if proc.poll() is None:
            proc.kill()


def stop_ranks() -> None:
    """Wait for the ranks to leave (after rank 0 sent them the stop), killing any still there; then this
    process may start others (a second engine)."""
    if not _ranks:
        return  # torchrun started them: it waits for them
    _stopping[0].set()
    deadline = time.monotonic() + STOP_WAIT_S
    for proc in _ranks:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
    _ranks.clear()
    for name in _SET_ENV:
        os.environ.pop(name, None)
