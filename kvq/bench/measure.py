"""Run a command and measure its wall time and the peak resident memory of its whole process tree.

Peak RSS is sampled (every `interval` s) as the sum over the process and all its descendants, so worker
pools count in full; `ru_maxrss` would only report the largest single process.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Measurement:
    wall_s: float
    peak_rss_bytes: int
    returncode: int
    output: str


def tree_rss(proc: psutil.Process) -> int:
    """Resident bytes of `proc` and all its live descendants."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def run_measured(
    argv: Sequence[str], env: dict[str, str] | None = None, interval: float = 0.05, cwd: str | None = None
) -> Measurement:
    """Run `argv` to completion; return wall time, sampled peak tree RSS, exit code and combined output."""
    with tempfile.TemporaryFile(mode="w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(
            list(argv),
            env={**os.environ, **(env or {})},
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        handle = psutil.Process(proc.pid)
        peak = 0
        while proc.poll() is None:
            try:
                peak = max(peak, tree_rss(handle))
            except psutil.NoSuchProcess:
                break
            time.sleep(interval)
        proc.wait()
        wall = time.perf_counter() - start
        log.seek(0)
        return Measurement(wall, peak, proc.returncode, log.read())
