"""Errors stay where they belong: a failure in one request's output handling ends that request (OpenAI's
error JSON, finish reason "error" when streaming) and the next hundred requests succeed; a stopped engine
thread turns /health and every request into 503 and `kvq serve` exits non-zero; no 5xx body is plain text.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from tests.serve.conftest import Running, running_server
from tests.serve.dying_serve import KILLER_PROMPT

BAD_PROMPT = [9, 9, 9]  # the request whose output handling fails


def fail_on_bad_prompt(seqs, logits, token_ids) -> None:
    """A token hook (the test's fault injection): raises for the request whose prompt is BAD_PROMPT."""
    if any(seq.token_ids[: seq.num_prompt_tokens] == BAD_PROMPT for seq in seqs):
        raise ValueError("injected fault")


@pytest.fixture(scope="module")
def tiny_engine(tiny_checkpoint) -> Engine:
    path = tiny_checkpoint("llama", "bf16")
    return Engine(EngineConfig(model=str(path), dtype="float32", kv_memory="16MiB", threads=2))


@pytest.fixture
def faulty(tiny_engine: Engine) -> Iterator[Running]:
    tiny_engine.token_hooks.append(fail_on_bad_prompt)
    try:
        with running_server(tiny_engine, "tiny") as running:
            yield running
    finally:
        tiny_engine.token_hooks.remove(fail_on_bad_prompt)


def completion(url: str, prompt: list[int], **body: object) -> httpx.Response:
    payload = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **body}
    return httpx.post(f"{url}/v1/completions", json=payload, timeout=60)


def test_a_fault_in_one_requests_output_ends_it_and_the_next_100_succeed(faulty: Running) -> None:
    reply = completion(faulty.url, BAD_PROMPT)
    error = reply.json()["error"]
    assert reply.status_code == 500 and error["type"] == "server_error" and error["code"] == 500
    assert "output handling failed (ValueError: injected fault)" in error["message"]
    with httpx.stream(
        "POST", f"{faulty.url}/v1/completions",
        json={"prompt": BAD_PROMPT, "max_tokens": 4, "stream": True, "temperature": 0}, timeout=60,
    ) as stream:  # fmt: skip
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert (
        parsed[-2]["choices"][0]["finish_reason"] == "error"
        and "injected fault" in parsed[-1]["error"]["message"]
    )
    for i in range(100):
        ok = completion(faulty.url, [5 + i % 50, 6, 7], max_tokens=1)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length", ok.text
    assert httpx.get(f"{faulty.url}/health").json() == {"status": "ok"}


def test_a_stopped_engine_thread_turns_health_and_requests_into_503(tiny_engine: Engine) -> None:
    with running_server(tiny_engine, "tiny") as running:
        assert httpx.get(f"{running.url}/health").status_code == 200

        def kill(engine: Engine) -> None:
            raise SystemExit("the test stopped the engine thread")

        running.async_engine.call(kill)
        deadline = time.monotonic() + 10
        while running.async_engine.dead_reason is None and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(f"{running.url}/health")
        assert health.status_code == 503 and "the engine stopped" in health.json()["error"]["message"]
        reply = completion(running.url, [5, 6, 7])
        assert reply.status_code == 503 and "the engine stopped" in reply.json()["error"]["message"]


def test_kvq_serve_exits_non_zero_when_its_engine_thread_stops(tiny_checkpoint) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [
        str(tiny_checkpoint("llama", "bf16")),
        "--port",
        str(port),
        "--kv-memory",
        "16MiB",
        "--threads",
        "1",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.serve.dying_serve", *argv], stderr=subprocess.PIPE, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                assert httpx.get(f"{url}/health").status_code == 200
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "kvq serve did not start"
                time.sleep(0.2)
        reply = completion(url, KILLER_PROMPT)
        assert reply.status_code == 503 and "EngineThreadKilled" in reply.json()["error"]["message"]
        assert proc.wait(timeout=30) == 1
        stderr = proc.stderr.read()
        assert "the engine thread stopped: EngineThreadKilled" in stderr
        assert "exiting with status 1: the engine stopped" in stderr
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
