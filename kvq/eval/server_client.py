"""OpenAI-compatible servers (vLLM, SGLang, `kvq serve`) for `kvq eval --server`: JSON over HTTP with
retries, the checks made before an evaluation starts (the server answers, serves the model name, returns
prompt log-probabilities) and which engine it is (`/v1/models` `owned_by`, `/version`).

Imports the standard library and kvq.errors only.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace

from kvq.errors import KvqError

RETRY_STATUSES = (408, 429, 500, 502, 503, 504)
CHECK_TIMEOUT_S = 60.0  # a check's request is one short prompt: a server silent this long is not answering
PROBE_PROMPT = "The capital of France is Paris, and the capital of Italy is"


@dataclass(frozen=True)
class Server:
    """One served model: `url` is the server's root (a trailing /v1 is dropped), `model` the served name."""

    url: str
    model: str
    api_key: str | None = None
    max_retries: int = 3
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", self.url.rstrip("/").removesuffix("/v1"))

    @property
    def completions_url(self) -> str:
        return f"{self.url}/v1/completions"

    def get(self, path: str) -> dict:
        return self._send(urllib.request.Request(self.url + path, headers=self._headers()))

    def post(self, path: str, body: dict) -> dict:
        data = json.dumps(body).encode()
        headers = self._headers() | {"Content-Type": "application/json"}
        return self._send(urllib.request.Request(self.url + path, data=data, headers=headers))

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _send(self, request: urllib.request.Request) -> dict:
        """The JSON answer; connection errors, timeouts, 429 and 5xx are retried with backoff, other
        4xx raise at once (`HTTPError` with the server's body readable)."""
        for attempt in range(self.max_retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                    return json.loads(answer.read())
            except urllib.error.HTTPError as e:
                if e.code not in RETRY_STATUSES or attempt == self.max_retries:
                    raise
            except (urllib.error.URLError, TimeoutError, ConnectionError):
                if attempt == self.max_retries:
                    raise
            time.sleep(min(2.0**attempt, 30.0))
        raise AssertionError("unreachable: the last attempt returns or raises")


def check_server(server: Server, needs_echo: bool, num_prompt_logprobs: int | None) -> dict:
    """The engine's {name, version, url, root}, after checking that `server` answers, serves `server.model`
    and returns what the evaluation reads; a `KvqError` names the missing feature otherwise."""
    server = replace(server, timeout_s=min(server.timeout_s, CHECK_TIMEOUT_S))
    try:
        listed = server.get("/v1/models").get("data") or []
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise KvqError(
            f"{server.url}/v1/models: no answer ({_reason(e)}); start the server first, or fix the URL "
            "(--server / --baseline-server take the root, e.g. http://localhost:8000)"
        ) from e
    names = [str(m.get("id")) for m in listed]
    if server.model not in names:
        raise KvqError(
            f"{server.url} serves {', '.join(names) or 'no model'}, not {server.model!r}: name the served "
            "model (vLLM's --served-model-name, kvq serve's --served-model-name) as MODEL / --baseline"
        )
    entry = listed[names.index(server.model)]
    if needs_echo:
        _check_echo(server)
    if num_prompt_logprobs is not None:
        _check_prompt_logprobs(server, num_prompt_logprobs)
    return {
        "name": str(entry.get("owned_by") or "unknown"),
        "version": _version(server),
        "url": server.url,
        "root": entry.get("root"),
        "max_model_len": entry.get("max_model_len"),
    }


def _check_echo(server: Server) -> None:
    body = {"model": server.model, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0.0}
    body |= {"echo": True, "logprobs": 1}
    found = _probe(server, body, "`echo: true` with `logprobs`")
    token_logprobs = ((found.get("choices") or [{}])[0].get("logprobs") or {}).get("token_logprobs")
    if not token_logprobs or token_logprobs[0] is not None or len(token_logprobs) < 3:
        raise KvqError(
            f"{server.url}/v1/completions returned no prompt log-probabilities for `echo: true` with "
            "`logprobs: 1` (lm-eval's local-completions scores multiple-choice and perplexity tasks with "
            "them); serve with vLLM, SGLang or kvq serve, or run generation tasks only"
        )


def _check_prompt_logprobs(server: Server, num: int) -> None:
    body = {"model": server.model, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0.0}
    body |= {"prompt_logprobs": num}
    found = _probe(server, body, f"vLLM's `prompt_logprobs: {num}`")
    entries = (found.get("choices") or [{}])[0].get("prompt_logprobs")
    if not entries or entries[0] is not None or not isinstance(entries[1], dict) or len(entries[1]) < num:
        raise KvqError(
            f"{server.url}/v1/completions returned no top-{num} `prompt_logprobs` (vLLM's request field; "
            "kvq eval reads perplexity, KL and top-1 agreement from them); serve with vLLM or kvq serve "
            "(--max-logprobs >= N on vLLM), lower --top-logprobs, or leave text out of --tasks"
        )


def _probe(server: Server, body: dict, feature: str) -> dict:
    try:
        return server.post("/v1/completions", body)
    except urllib.error.HTTPError as e:
        raise KvqError(
            f"{server.url}/v1/completions refused {feature} (HTTP {e.code}: {_reason(e)}); kvq eval --server "
            "needs it"
        ) from e
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise KvqError(f"{server.url}/v1/completions: no answer ({_reason(e)})") from e


def _version(server: Server) -> str | None:
    """vLLM and SGLang answer /version with {"version": ...}; a server without it has none."""
    try:
        return str(server.get("/version").get("version")) or None
    except (urllib.error.URLError, OSError, ValueError, AttributeError):
        return None


def _reason(error: Exception) -> str:
    if isinstance(error, urllib.error.HTTPError):
        try:
            return error.read().decode(errors="replace")[:300]
        except OSError:
            return str(error)
    return str(getattr(error, "reason", error))
