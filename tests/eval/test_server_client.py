"""The checks `kvq eval --server` makes before it starts, against a toy server: a wrong model name, no
prompt log-probabilities (either kind) and no server at all are refused, each naming what is missing."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvq.errors import KvqError
from kvq.eval.server_client import Server, check_server


class NoPromptLogprobs(BaseHTTPRequestHandler):
    """A server that lists `m` and answers completions without any prompt log-probabilities."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._reply({"data": [{"id": "m", "owned_by": "toy"}]} if self.path == "/v1/models" else None)

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self._reply({"choices": [{"text": "x", "logprobs": None}]})

    def _reply(self, body: dict | None) -> None:
        data = json.dumps(body or {"error": "not found"}).encode()
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def test_checks_name_what_is_missing() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), NoPromptLogprobs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(KvqError, match=r"serves m, not 'other': name the served model"):
            check_server(Server(url, "other", max_retries=0), True, None)
        with pytest.raises(
            KvqError, match=r"no prompt log-probabilities for `echo: true` with `logprobs: 1`"
        ):
            check_server(Server(url, "m", max_retries=0), True, None)
        with pytest.raises(KvqError, match=r"no top-20 `prompt_logprobs` \(vLLM's request field"):
            check_server(Server(url, "m", max_retries=0), False, 20)
        assert check_server(Server(url + "/v1", "m"), False, None)["name"] == "toy"  # /v1 is dropped
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(KvqError, match="no answer .* start the server first"):
        check_server(Server(url, "m", max_retries=0), True, None)
