"""vLLM's request surface, as tools written for vLLM send it: unknown fields ignored with one warning,
vLLM's extensions honoured (continuous usage stats, min_tokens, include_stop_str_in_output,
skip_special_tokens, logit_bias, truncate_prompt_tokens, content as parts), and the prompt's own
log-probabilities (`echo` with `logprobs`, `max_tokens` 0 and 1, and vLLM's `prompt_logprobs`) equal to
the engine's prefill scores. On the embedded SmolLM2 in fp32 reference mode.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import httpx
import pytest

from kvq.runtime.engine import Engine
from kvq.runtime.sampling import SamplingParams
from tests.serve.conftest import Running, running_server

PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def server(smollm2_engine: Engine) -> Iterator[Running]:
    with running_server(smollm2_engine) as running:
        yield running


def post(server: Running, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", json={"model": "smollm2", **body}, timeout=120)


def events(server: Running, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}/v1/{path}", json={**body, "stream": True}, timeout=120) as reply:
        assert reply.status_code == 200
        lines = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def engine_prompt_entries(server: Running, prompt_ids: list[int], num_top: int) -> list:
    params = SamplingParams(max_tokens=0, prompt_logprobs=num_top)
    out = server.async_engine.call(lambda e: e.generate([prompt_ids], params)[0]).result(timeout=120)
    return out.prompt_logprobs


def test_unknown_fields_are_ignored_with_one_warning(server: Running, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kvq.serve"):
        reply = post(
            server, "completions", {"prompt": PROMPT, "max_tokens": 2, "frobnicate": 1, "cache_salt": "x"}
        )
    assert reply.status_code == 200, reply.text
    warnings = [r.getMessage() for r in caplog.records if "ignoring fields" in r.getMessage()]
    assert warnings == ["/v1/completions: ignoring fields kvq does not know: cache_salt, frobnicate"]


def test_a_guidellm_style_chat_stream_reports_usage_in_every_chunk(server: Running) -> None:
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Count to ten."}]}],
        "max_tokens": 6, "max_completion_tokens": 6, "ignore_eos": True, "temperature": 0,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    chunks = events(server, "chat/completions", body)
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    prompt_tokens = usages[0]["prompt_tokens"]
    assert prompt_tokens > 5 and all(u["prompt_tokens"] == prompt_tokens for u in usages)
    completion = [u["completion_tokens"] for u in usages if chunks[usages.index(u)]["choices"]]
    assert completion == sorted(completion) and usages[-1]["completion_tokens"] == 6
    assert chunks[-1]["choices"] == [] and usages[-1]["total_tokens"] == prompt_tokens + 6


def test_min_tokens_and_include_stop_str(server: Running) -> None:
    text = post(server, "completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()
    text = text["choices"][0]["text"]
    stop = text.strip()[:3]
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop": [stop]}
    kept = post(server, "completions", {**body, "include_stop_str_in_output": True}).json()["choices"][0]
    assert kept["finish_reason"] == "stop" and kept["text"] == text[: text.index(stop) + len(stop)]
    eos = server.engine.tokenizer.eos_token_id
    forced = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logit_bias": {str(eos): 100}}
    assert post(server, "completions", forced).json()["choices"][0]["finish_reason"] == "stop"
    held = post(server, "completions", {**forced, "min_tokens": 3}).json()["choices"][0]
    assert held["finish_reason"] == "length"  # EOS held back until 3 tokens, then max_tokens ends it


def test_skip_special_tokens(server: Running) -> None:
    eos = server.engine.tokenizer.eos_token_id
    body = {
        "prompt": PROMPT,
        "max_tokens": 2,
        "ignore_eos": True,
        "temperature": 0,
        "logit_bias": {str(eos): 100},
    }
    assert post(server, "completions", body).json()["choices"][0]["text"] == ""
    shown = post(server, "completions", {**body, "skip_special_tokens": False}).json()["choices"][0]["text"]
    assert shown == server.engine.tokenizer.eos_token * 2


def test_truncate_prompt_tokens_keeps_the_last_ones(server: Running) -> None:
    reply = post(server, "completions", {"prompt": PROMPT, "max_tokens": 1, "truncate_prompt_tokens": 4})
    assert reply.json()["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt(server: Running, max_tokens: int) -> None:
    """What lm-evaluation-harness's local-completions sends for a loglikelihood request."""
    ids = server.engine.encode(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "echo": True, "logprobs": 2, "temperature": 0}
    choice = post(server, "completions", body).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + max_tokens and choice["text"].startswith(PROMPT)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = engine_prompt_entries(server, ids, 2)
    for found, want in zip(logprobs["token_logprobs"][1 : len(ids)], expected[1:], strict=True):
        assert abs(found - want.logprob) < 1e-4
    for top, want in zip(logprobs["top_logprobs"][1 : len(ids)], expected[1:], strict=True):
        assert set(top) >= {t.token for t in want.top} | {want.token}
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])


def test_echo_with_logprobs_by_token_ids_and_streamed(server: Running) -> None:
    ids = server.engine.encode(PROMPT)
    whole = post(
        server, "completions", {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    )
    chunks = events(
        server, "completions", {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    )
    streamed = [t for c in chunks for t in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == whole.json()["choices"][0]["logprobs"]["token_logprobs"]


def test_vllm_prompt_logprobs(server: Running) -> None:
    ids = server.engine.encode(PROMPT)
    choice = post(server, "completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 1}).json()
    found = choice["choices"][0]["prompt_logprobs"]
    expected = engine_prompt_entries(server, ids, 1)
    assert found[0] is None and len(found) == len(ids)
    for entry, want in zip(found[1:], expected[1:], strict=True):
        assert abs(entry[str(want.token_id)]["logprob"] - want.logprob) < 1e-4
        assert entry[str(want.token_id)]["rank"] == want.rank
        assert entry[str(want.top[0].token_id)]["rank"] == 1
    chat = post(
        server,
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0},
    )
    assert chat.json()["prompt_logprobs"][0] is None


@pytest.mark.parametrize(
    ("method", "path", "content", "status"),
    [
        ("POST", "/v1/completions", b"\xff\xfe{", 400),
        ("POST", "/v1/chat/completions", b"\x00" * 9, 400),
        ("GET", "/v1/completions", b"", 405),
        ("GET", "/v1/nothing", b"", 404),
    ],
)
def test_what_fastapi_refuses_is_in_openai_shape(server: Running, method, path, content, status) -> None:
    headers = {"content-type": "application/json"}
    reply = httpx.request(method, f"{server.url}{path}", content=content, headers=headers, timeout=30)
    assert reply.status_code == status and set(reply.json()["error"]) == {"message", "type", "param", "code"}
