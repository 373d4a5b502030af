"""`kvq serve ...` as a child process on a free loopback port, up once /health answers (bounded wait)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


@contextmanager
def kvq_serve(args: list[str], timeout_s: float = 240) -> Iterator[str]:
    """The URL of `kvq serve <args> --port P` once it answers; on exit Ctrl-C, and it must exit 0."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "kvq", "serve", *args, "--port", str(port)])
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout_s
        while True:
            try:
                httpx.get(f"{url}/health")
                break
            except httpx.TransportError:
                assert proc.poll() is None, f"kvq serve exited with status {proc.returncode}"
                assert time.monotonic() < deadline, f"kvq serve did not answer in {timeout_s} s"
                time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
