"""`/metrics` of a real server, parsed by prometheus_client's own text parser: counters and histograms
move by exactly what the requests did (tokens, finish reasons, prefix-cache hits, a failed KV page
check), gauges read the engine (pages, running and waiting requests), and a non-streaming client that
goes away aborts its request."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvq.drill.fault_injector import FaultInjector
from kvq.runtime.engine import Engine
from tests.serve.conftest import Running, running_server

VLLM_NAMES = [  # vLLM's metric names that kvq serves under kvq:
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
    "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens", "request_success",
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds",
]  # fmt: skip


@pytest.fixture(scope="module")
def server(smollm2_engine: Engine) -> Iterator[Running]:
    with running_server(smollm2_engine) as running:
        yield running


def scrape(server: Running) -> dict[str, float]:
    """Every sample by name (labels appended as {k=v}), through prometheus_client's parser."""
    text = httpx.get(f"{server.url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            le = s.labels.get("le")
            key = s.name + (f"{{{labels}}}" if labels else "") + (f"[le={le}]" if le else "")
            samples[key] = s.value
    return samples


def moved(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after[name] - before.get(name, 0.0)


def test_families_are_vllms_names_under_kvq(server: Running) -> None:
    text = httpx.get(f"{server.url}/metrics").text
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {f"kvq:{n}" for n in VLLM_NAMES} <= names
    assert {"kvq:kv_cache_pages_used", "kvq:kv_cache_pages_total", "kvq:integrity_aborts"} <= names
    samples = scrape(server)
    assert samples["kvq:kv_cache_pages_total"] == server.engine.block_manager.num_pages
    assert samples["kvq:kv_cache_pages_used"] == 0 and samples["kvq:num_requests_running"] == 0


def test_counters_move_by_what_the_requests_did(server: Running) -> None:
    prompt = "Metrics test " + " ".join(f"w{i}" for i in range(60))  # fresh: no earlier prefix pages
    num_prompt = len(server.engine.encode(prompt))
    assert num_prompt >= 2 * server.engine.config.page_size
    before = scrape(server)
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).status_code == 200
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        assert [line for line in r.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"
    after = scrape(server)
    assert moved(before, after, "kvq:prompt_tokens_total") == 2 * num_prompt
    assert moved(before, after, "kvq:generation_tokens_total") == 10
    assert moved(before, after, "kvq:request_success_total{finished_reason=length}") == 2
    assert moved(before, after, "kvq:time_to_first_token_seconds_count") == 2
    assert moved(before, after, "kvq:e2e_request_latency_seconds_count") == 2
    assert moved(before, after, "kvq:request_queue_time_seconds_count") == 2
    assert moved(before, after, "kvq:inter_token_latency_seconds_count") == 2 * 4  # tokens after the first
    assert moved(before, after, "kvq:prefix_cache_queries_total") == 2 * num_prompt
    page = server.engine.config.page_size
    assert moved(before, after, "kvq:prefix_cache_hits_total") == (num_prompt - 1) // page * page  # 2nd
    assert after["kvq:time_to_first_token_seconds_sum"] > before.get("kvq:time_to_first_token_seconds_sum", 0)
    assert after["kvq:kv_cache_pages_used"] == 0 and after["kvq:num_requests_waiting"] == 0


def test_a_failed_page_check_counts_as_an_integrity_abort(server: Running) -> None:
    async_engine = server.async_engine
    async_engine.call(lambda e: e.reset_kv(kv_integrity="tags")).result(timeout=30)
    try:
        before = scrape(server)
        body = {"prompt": "Count to fifty:", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            async_engine.call(lambda e: FaultInjector(e).off_by_one(e.scheduler.running[0].seq_id, 0))
            last = [json.loads(x[6:]) for x in lines if x.startswith("data: {")][-1]
        assert "KV integrity" in last["error"]["message"]
        after = scrape(server)
        assert moved(before, after, "kvq:integrity_aborts_total") == 1
        assert moved(before, after, "kvq:request_success_total{finished_reason=error}") == 1
    finally:
        async_engine.call(lambda e: e.reset_kv(kv_integrity="off")).result(timeout=30)


def test_a_non_streaming_client_that_goes_away_aborts_its_request(server: Running) -> None:
    engine = server.engine
    before = scrape(server)
    body = {"prompt": "Write a long story.", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 2 s and closes the connection
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=2.0))
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    after = scrape(server)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages
    assert moved(before, after, "kvq:request_success_total{finished_reason=abort}") == 1
    assert moved(before, after, "kvq:generation_tokens_total") < 1000
