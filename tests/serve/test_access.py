"""Who may send what to a real server: the API key (401 in OpenAI's shape, for httpx and the openai
client), the bounded queue (429 with Retry-After, counted in /metrics), request limits (400 naming the
field), bodies too large (413)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvq.runtime.engine import Engine
from tests.serve.conftest import Running, running_server
from tests.serve.test_metrics import scrape

openai = pytest.importorskip("openai")

KEY = "sk-kvq-test-0123456789"
BODY = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(smollm2_engine: Engine) -> Iterator[Running]:
    with running_server(
        smollm2_engine,
        api_key=KEY,
        metrics_need_key=False,
        max_waiting=2,
        retry_after=3,
        max_prompt_tokens=64,
        max_completion_tokens=100,
        max_body_bytes="8KiB",
    ) as running:
        yield running


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    ("headers", "fragment"),
    [
        ({}, "no API key"),
        ({"Authorization": "Basic abc"}, "no API key"),
        (auth("sk-wrong"), "incorrect API key"),
        (auth(KEY + "x"), "incorrect API key"),
    ],
)
def test_v1_needs_the_key(server: Running, headers, fragment) -> None:
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
        reply = httpx.request(method, f"{server.url}{path}", json=BODY, headers=headers)
        assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
        error = reply.json()["error"]
        assert fragment in error["message"] and error["code"] == "invalid_api_key"
        assert error["type"] == "invalid_request_error"


def test_the_key_opens_v1_and_health_and_metrics_stay_open(server: Running) -> None:
    assert (
        httpx.post(f"{server.url}/v1/completions", json=BODY, headers=auth(), timeout=60).status_code == 200
    )
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_the_openai_client_with_and_without_the_key(server: Running) -> None:
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model="smollm2", **BODY).usage.completion_tokens == 4
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.completions.create(model="smollm2", **BODY)
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


def test_metrics_need_key(smollm2_engine: Engine) -> None:
    with running_server(smollm2_engine, api_key=KEY, metrics_need_key=True) as locked:
        assert httpx.get(f"{locked.url}/metrics").status_code == 401
        assert httpx.get(f"{locked.url}/metrics", headers=auth()).status_code == 200
        assert httpx.get(f"{locked.url}/health").status_code == 200


def test_a_full_queue_gets_429_with_retry_after(server: Running) -> None:
    """The engine thread is held (a blocking call), so accepted requests stay waiting: two fill
    --max-waiting 2, the third is refused; released, the two complete."""
    release = threading.Event()
    held = server.async_engine.call(lambda e: release.wait(60))
    before = scrape(server)
    try:
        with ThreadPoolExecutor(2) as pool:
            waiting = [
                pool.submit(
                    httpx.post, f"{server.url}/v1/completions", json=BODY, headers=auth(), timeout=120
                )
                for _ in range(2)
            ]
            deadline = time.monotonic() + 30
            while server.async_engine.num_waiting < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert scrape(server)["kvq:num_requests_waiting"] == 2
            refused = httpx.post(f"{server.url}/v1/completions", json=BODY, headers=auth(), timeout=60)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "3"
            assert "queue is full" in refused.json()["error"]["message"]
            n3 = httpx.post(f"{server.url}/v1/completions", json={**BODY, "n": 3}, headers=auth(), timeout=60)
            assert n3.status_code == 429  # n choices count as n requests
            release.set()
            assert [f.result().status_code for f in waiting] == [200, 200]
    finally:
        release.set()
        held.result(timeout=60)
    after = scrape(server)
    assert after["kvq:admission_rejections_total"] - before["kvq:admission_rejections_total"] == 2


@pytest.mark.parametrize(
    ("body", "status", "param", "fragment"),
    [
        ({"prompt": "word " * 80}, 400, "prompt", "at most 64 (--max-prompt-tokens)"),
        ({"prompt": "hi", "max_tokens": 101}, 400, "max_tokens", "at most 100 tokens per request"),
        ({"prompt": "hi " * 3000}, 413, "body", "at most 8192 (--max-body-bytes)"),
    ],
)
def test_request_limits_name_the_field(server: Running, body, status, param, fragment) -> None:
    reply = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth(), timeout=60)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert fragment in error["message"] and error["param"] == param


def test_context_overflow_names_both_numbers(smollm2_engine: Engine) -> None:
    with running_server(smollm2_engine) as plain:
        reply = httpx.post(f"{plain.url}/v1/completions", json={"prompt": "hi", "max_tokens": 100_000_000})
        assert reply.status_code == 400
        message = reply.json()["error"]["message"]
        assert "maximum context length is 8192 tokens" in message
        assert "you requested 100000001 tokens (1 in the prompt, 100000000 in the completion)" in message
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9000}
        assert "maximum context length" in httpx.post(f"{plain.url}/v1/chat/completions", json=chat).text
