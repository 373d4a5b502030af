"""Property: whatever body a client posts to `/v1/completions` or `/v1/chat/completions`, `kvq serve`
answers 2xx or a 4xx in OpenAI's error shape, never a 5xx (nor an error event from a failed engine in a
200 stream), and the next valid request gets the same answer as before. Bounded examples (make test)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from tests.clients.request_bodies import CHAT, COMPLETION, bodies
from tests.serve.conftest import Running, running_server

NUM_EXAMPLES = 60
FUZZ = settings(
    max_examples=NUM_EXAMPLES,
    deadline=None,
    derandomize=True,  # the same bodies on every run: a failure reproduces
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
)
ROUTES = {"completions": ("/v1/completions", COMPLETION), "chat": ("/v1/chat/completions", CHAT)}


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator[Running]:
    engine = Engine(
        EngineConfig(
            model=str(tiny_checkpoint("llama", "bf16")), dtype="float32", kv_memory="16MiB", threads=2
        )
    )
    # bounded work per request: a valid body with large max_tokens, n or prompt is a 400, not minutes
    with running_server(
        engine, model_name="tiny", max_tokens=8, max_prompt_tokens=256, max_completion_tokens=16
    ) as s:
        yield s


@pytest.fixture(scope="module")
def http(server: Running) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def assert_openai_error(response: httpx.Response) -> None:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)


def assert_stream_has_no_server_error(response: httpx.Response) -> None:
    events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", response.text[-500:]
    for event in events[:-1]:
        payload = json.loads(event)
        if "error" in payload:
            assert int(payload["error"]["code"]) < 500, payload


def answer(http: httpx.Client, route: str) -> str:
    path, valid = ROUTES[route]
    response = http.post(path, json=valid)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"] if route == "completions" else choice["message"]["content"]


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_any_body_gets_2xx_or_an_openai_4xx(server: Running, http: httpx.Client, route: str) -> None:
    path, valid = ROUTES[route]
    before = answer(http, route)

    @FUZZ
    @given(body=bodies(valid))
    def post(body: bytes) -> None:
        response = http.post(path, content=body, headers={"content-type": "application/json"})
        assert response.status_code < 500, (response.status_code, response.text[:500], body[:500])
        if response.status_code >= 400:
            assert_openai_error(response)
        elif response.headers["content-type"].startswith("text/event-stream"):
            assert_stream_has_no_server_error(response)
        else:
            assert response.json()["choices"]
        assert answer(http, route) == before  # the engine goes on serving, unchanged

    post()
    assert not server.engine.has_unfinished_requests()
