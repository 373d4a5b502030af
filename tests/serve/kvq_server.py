"""`kvq serve` as a subprocess on a free loopback port, for the tests: up until /health answers, stopped
with Ctrl-C (which must exit 0)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


@contextmanager
def kvq_serve(model: Path, *options: str, timeout: float = 300) -> Iterator[str]:
    """The server's base URL while `kvq serve MODEL --port P *options` runs."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [sys.executable, "-m", "kvq", "serve", str(model), "--port", str(port), *options]
    proc = subprocess.Popen(argv, text=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{url}/health")
                break
            except httpx.TransportError:
                time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
