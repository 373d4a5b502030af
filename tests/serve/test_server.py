"""`kvq serve` on loopback: a real uvicorn server in a thread, real HTTP from httpx, the embedded SmolLM2.

Greedy answers over HTTP equal `Engine.generate` on the same engine (fp32 reference mode, so batching
across clients cannot flip a near-tied token); streams add up to the same text; concurrent clients share
engine steps; bad requests get 400/404 with the reason; a client that goes away frees its KV pages.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from kvq.drill.fault_injector import FaultInjector
from kvq.runtime.engine import Engine
from kvq.runtime.sampling import SamplingParams
from kvq.serve.async_engine import AsyncEngine
from tests.serve.conftest import running_server

PROMPTS = [
    "The capital of France is",
    "Water boils at",
    "The largest planet in the solar system is",
    "A haiku about autumn:",
    "def fibonacci(n):",
    "The three primary colors are",
]
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a fruit."}]
MAX_TOKENS = 12


@dataclass
class Server:
    url: str
    engine: Engine
    async_engine: AsyncEngine
    expected: dict[str, str]  # prompt -> greedy completion of MAX_TOKENS
    expected_chat: str


@pytest.fixture(scope="module")
def server(smollm2_engine: Engine) -> Iterator[Server]:
    engine = smollm2_engine
    greedy = SamplingParams(max_tokens=MAX_TOKENS)
    expected = {p: out.text for p, out in zip(PROMPTS, engine.generate(PROMPTS, greedy), strict=True)}
    expected_chat = engine.generate([engine.encode_messages(CHAT)], greedy)[0].text
    with running_server(engine, max_tokens=64) as running:
        yield Server(running.url, engine, running.async_engine, expected, expected_chat)


def events(response: httpx.Response) -> list[dict]:
    """The JSON events of a server-sent event stream, which must end with [DONE]."""
    data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_health_and_models(server: Server) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    models = httpx.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["smollm2"]
    assert models["data"][0]["max_model_len"] == server.engine.max_model_len


def test_completion_is_the_engines_greedy_answer(server: Server) -> None:
    prompt = PROMPTS[0]
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    choice = reply["choices"][0]
    assert choice["text"] == server.expected[prompt] and "Paris" in choice["text"]
    assert choice["finish_reason"] == "length" and reply["object"] == "text_completion"
    prompt_tokens = len(server.engine.encode(prompt))
    assert reply["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": MAX_TOKENS,
        "total_tokens": prompt_tokens + MAX_TOKENS,
    }
    by_ids = {**body, "prompt": server.engine.encode(prompt)}  # token ids instead of text
    assert (
        httpx.post(f"{server.url}/v1/completions", json=by_ids, timeout=60).json()["choices"][0]["text"]
        == (server.expected[prompt])
    )


def test_streamed_completion_adds_up_to_the_same_text(server: Server) -> None:
    prompt = PROMPTS[1]
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = events(response)
    assert "".join(c["choices"][0]["text"] for c in chunks) == server.expected[prompt]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_chat_completion_plain_and_streamed(server: Server) -> None:
    body = {"messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": server.expected_chat}
    assert reply["object"] == "chat.completion"
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}) as response:
        chunks = events(response)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == server.expected_chat
    assert chunks[-1]["object"] == "chat.completion.chunk"


def test_concurrent_clients_share_engine_steps(server: Server) -> None:
    def ask(prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]

    server.engine.stats.largest_batch = 0
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(ask, PROMPTS))
    assert answers == [server.expected[p] for p in PROMPTS]
    assert server.engine.stats.largest_batch > 1  # requests of different clients decoded together


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 100_000}, 400, "maximum context length is 8192"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 8000}, 400, "KV pages but the pool has"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens must be >= 0"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            400,
            "max_tokens",
        ),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature must be >= 0"),
        ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "n: Input should be less than or equal to 16"),
        (
            "/v1/completions",
            {"prompt": "hi", "presence_penalty": 3},
            400,
            "presence_penalty must be in [-2, 2]",
        ),
        ("/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "best_of"),
        ("/v1/completions", {"prompt": "hi", "use_beam_search": True}, 400, "use_beam_search: kvq does not"),
        (
            "/v1/completions",
            {"prompt": "hi", "response_format": {"type": "json_object"}},
            400,
            "response_format",
        ),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias keys are token ids"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, 400, "in the vocabulary"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream: true"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            400,
            "tools: kvq does not implement tool calling",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            400,
            "'image_url' are not supported",
        ),
        ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "'gpt-4' is not served here"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ],
)
def test_bad_requests_are_refused_by_name(server: Server, path, body, status, fragment) -> None:
    reply = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert fragment in error["message"] and error["code"] == status


def test_a_client_that_goes_away_frees_its_pages(server: Server) -> None:
    engine = server.engine
    body = {"prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # the connection is closed after a few tokens of 400
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


def test_a_request_the_engine_stops_gets_its_error(server: Server) -> None:
    """A real failed KV page check: with --kv-integrity tags, a block-table slip injected into the running
    request (`FaultInjector.off_by_one`) ends it with finish reason "error", which the client gets as a
    500 (or, streaming, an error event after the text so far)."""
    engine, async_engine = server.engine, server.async_engine
    async_engine.call(lambda e: e.reset_kv(kv_integrity="tags")).result(timeout=30)
    aborts_before = engine.stats.integrity_aborts  # the engine is the session's: other modules' aborts

    def inject_when_running() -> None:
        deadline = time.monotonic() + 60
        while not engine.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.01)
        running = async_engine.call(lambda e: [s.seq_id for s in e.scheduler.running]).result(timeout=30)
        async_engine.call(lambda e: FaultInjector(e).off_by_one(running[0], 0)).result(timeout=30)

    body = {"prompt": PROMPTS[3], "max_tokens": 400, "temperature": 0}
    try:
        with ThreadPoolExecutor(1) as pool:
            injected = pool.submit(inject_when_running)
            reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            injected.result()
        assert reply.status_code == 500
        message = reply.json()["error"]["message"]
        assert "KV integrity" in message and "(logical page 0)" in message
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            async_engine.call(lambda e: FaultInjector(e).off_by_one(e.scheduler.running[0].seq_id, 0))
            data = [json.loads(first[6:])] + [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert data[-2]["choices"][0]["finish_reason"] == "error"
        assert "KV integrity" in data[-1]["error"]["message"]
        assert len("".join(d["choices"][0]["text"] for d in data[:-1])) > 0  # the text sent before the stop
        assert not engine.has_unfinished_requests() and engine.stats.integrity_aborts == aborts_before + 2
    finally:
        async_engine.call(lambda e: e.reset_kv(kv_integrity="off")).result(timeout=30)
