"""The servers `kvq bench serve` measures: already running (`--url`), or started for their turn and stopped
after it (`--config FILE`: `kvq serve --config FILE`; `--launch LABEL=COMMAND`: any server command with
`{port}` in it, e.g. vLLM's), so that servers sharing the machine's cores never run at the same time.
Imports httpx and kvq.errors.
"""

from __future__ import annotations

import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvq.errors import KvqError

STARTUP_TIMEOUT_S = 900.0  # vLLM's CPU build compiles and profiles for minutes on 2 cores


@dataclass(frozen=True)
class ServerSpec:
    label: str
    url: str | None = None  # already running
    command: str | None = None  # started for its turn; "{port}" is replaced


def parse_servers(urls: list[str], configs: list[Path], launches: list[str]) -> list[ServerSpec]:
    """`--url [LABEL=]URL`, `--config FILE` and `--launch LABEL=COMMAND`, in that order."""
    specs = []
    for value in urls:
        label, _, url = value.rpartition("=") if "=" in value.split("://")[0] else ("", "", value)
        specs.append(ServerSpec(label or url, url=url.rstrip("/")))
    for path in configs:
        if not path.is_file():
            raise KvqError(f"--config {path}: no such file; pass a serving config (see configs/)")
        command = (
            f"{shlex.quote(sys.executable)} -m kvq serve --config {shlex.quote(str(path))} --port {{port}}"
        )
        specs.append(ServerSpec(f"kvq {path.stem}", command=command))
    for value in launches:
        label, sep, command = value.partition("=")
        if not sep or "{port}" not in command:
            raise KvqError(f"--launch {value!r}: expected LABEL=COMMAND with {{port}} in COMMAND")
        specs.append(ServerSpec(label, command=command))
    if not specs:
        raise KvqError("no server to measure: pass --url URL, --config FILE or --launch LABEL=COMMAND")
    return specs


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def server_up(spec: ServerSpec, log: Path | None = None) -> Iterator[str]:
    """The server's base URL while it is up (started and stopped here when it has a command)."""
    if spec.url is not None:
        yield spec.url
        return
    assert spec.command is not None
    port = free_port()
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen(shlex.split(spec.command.format(port=port)), stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, spec)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log is not None:
            out.close()  # type: ignore[union-attr]


def wait_healthy(url: str, proc: subprocess.Popen, spec: ServerSpec) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise KvqError(f"server {spec.label!r} exited with status {proc.returncode} before it answered")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise KvqError(f"server {spec.label!r} did not answer /health within {STARTUP_TIMEOUT_S:.0f} s")
