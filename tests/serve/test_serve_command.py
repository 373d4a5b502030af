"""`kvq serve` as a process: a --config file with flags over it, the banner, and a graceful SIGTERM:
a request that finishes within --shutdown-timeout completes, one still running then ends with an error
event (streaming) or a 503, and the process exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from kvq.bench.serve_servers import ServerSpec, free_port, wait_healthy


def test_kvq_serve_drains_on_sigterm(smollm2, tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"model: {smollm2.bf16}\n"
        "engine: {kv_memory: 64MiB, threads: 1}\n"
        "server: {served_model_name: from-file, port: 1, shutdown_timeout: 4}\n"
    )
    argv = [sys.executable, "-m", "kvq", "serve", "--config", str(config), "--port", str(port)]
    proc = subprocess.Popen([*argv, "--served-model-name", "tiny"], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, ServerSpec("kvq serve"))
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        assert reply["model"] == "tiny" and reply["usage"]["completion_tokens"] <= 4  # flags over the file

        long = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
        results: dict[str, object] = {}
        streaming = threading.Event()

        def stream() -> None:
            with httpx.stream(
                "POST", f"{url}/v1/completions", json={**long, "stream": True}, timeout=120
            ) as r:
                events: list[str] = []
                results["events"] = events
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        streaming.set()

        def plain() -> None:
            results["plain"] = httpx.post(f"{url}/v1/completions", json=long, timeout=120)

        def short() -> None:
            try:
                results["short"] = httpx.post(
                    f"{url}/v1/completions", json={**long, "max_tokens": 3}, timeout=60
                )
            except httpx.TransportError:  # the server stopped listening first
                results["short"] = None

        threads = [threading.Thread(target=f) for f in (stream, plain)]
        for t in threads:
            t.start()
        assert streaming.wait(timeout=120)
        while "kvq:num_requests_running 2.0" not in httpx.get(f"{url}/metrics").text:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        short_thread = threading.Thread(target=short)
        short_thread.start()
        threads.append(short_thread)
        for t in threads:
            t.join(timeout=120)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    events = results["events"]
    assert isinstance(events, list) and events[-1] == "[DONE]"
    assert "the request was stopped" in json.loads(events[-2])["error"]["message"]
    assert any(json.loads(e).get("choices") for e in events[:-2])  # text came before the stop
    plain_reply = results["plain"]
    assert isinstance(plain_reply, httpx.Response) and plain_reply.status_code == 503
    short_reply = results.get("short")  # sent after SIGTERM: refused (503) or the socket already closed
    assert short_reply is None or short_reply.status_code == 503
    stderr = proc.stderr.read() if proc.stderr else ""
    assert "kvq serve: tiny on http://127.0.0.1" in stderr and "this machine only (loopback)" in stderr
    assert "shutting down; running requests get 4 s to finish" in stderr
