"""A bounded load test on a real server: 64 concurrent streaming clients over a fixed set of requests
(tiny llama fixture, fp32, greedy), a fifth of them leaving mid-stream and some sending malformed bodies.

No valid request gets a 5xx; every one that stays completes with the text it gets when sent alone; the
malformed ones get 400; afterwards no request is left, every KV page is free again, and the process RSS
is within a small bound of what it was after a warm-up round of the same load.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import psutil
import pytest

from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.sampling import SamplingParams
from tests.serve.conftest import running_server

pytestmark = pytest.mark.slow

NUM_CLIENTS = 64
NUM_REQUESTS = 128
MAX_TOKENS = 12
RSS_BOUND = 64 * 2**20
MALFORMED = [
    b"{not json",
    json.dumps({"prompt": 5, "stream": True}).encode(),
    json.dumps({"prompt": "x", "max_tokens": "many", "stream": True}).encode(),
    json.dumps({"prompt": "x", "stream": True, "temperature": -3}).encode(),
]


def prompt_of(i: int) -> list[int]:
    """Token ids: 40 prompts of 5 to 40 tokens; every third starts with one of 7 shared pages."""
    k = i % 40
    own = [10 + (11 * k + j) % 250 for j in range(5 + k % 24)]
    return [3 + k % 7] * 16 + own if k % 3 == 0 else own


async def one(client: httpx.AsyncClient, url: str, i: int) -> tuple[str, int, str | None]:
    """(kind, status, text): kind 'malformed', 'leaves' (closes after two chunks) or 'valid'."""
    if i % 8 == 7:
        reply = await client.post(
            url, content=MALFORMED[i % len(MALFORMED)], headers={"content-type": "application/json"}
        )
        return "malformed", reply.status_code, None
    body = {
        "prompt": prompt_of(i),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    leaves = i % 5 == 2
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            return "valid", response.status_code, await response.aread()
        text, chunks = "", 0
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return "valid", 500, event["error"]["message"]
            text += event["choices"][0]["text"]
            chunks += 1
            if leaves and chunks == 2:
                return "leaves", 200, None
    return "valid", 200, text


async def load(url: str) -> list[tuple[int, tuple[str, int, str | None]]]:
    # one connection per request: a kept-alive connection idle past uvicorn's keep-alive timeout (5 s, as
    # vLLM's) is closed by the server just as the client may reuse it (a ReadError that a loaded machine
    # makes likely), a race of HTTP keep-alive, not of the server under test
    limits = httpx.Limits(max_connections=NUM_CLIENTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        gate = asyncio.Semaphore(NUM_CLIENTS)

        async def client_request(i: int):
            async with gate:
                return i, await one(client, f"{url}/v1/completions", i)

        return await asyncio.gather(*(client_request(i) for i in range(NUM_REQUESTS)))


def test_64_streaming_clients_some_leaving_some_malformed(tiny_checkpoint) -> None:
    config = EngineConfig(
        model=str(tiny_checkpoint("llama", "bf16")),
        dtype="float32",
        kv_memory="32MiB",
        max_num_seqs=64,
        threads=2,
    )
    engine = Engine(config)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = {k: engine.generate([prompt_of(k)], greedy)[0].text for k in range(40)}  # one at a time
    process = psutil.Process()
    with running_server(engine, model_name="tiny") as server:
        asyncio.run(load(server.url))  # warm-up: allocator pools, tokenizer, code paths
        rss_before = process.memory_info().rss
        results = asyncio.run(load(server.url))
        deadline = time.monotonic() + 30
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.has_unfinished_requests()
        assert engine.block_manager.num_free_pages == engine.block_manager.num_pages
        assert server.async_engine.num_waiting == 0 and server.async_engine.num_running == 0
        assert engine.stats.largest_batch > 16  # the clients were batched together
        rss_after = process.memory_info().rss
    kinds = [kind for _, (kind, _, _) in results]
    assert kinds.count("malformed") == NUM_REQUESTS // 8
    assert kinds.count("leaves") == sum(1 for i in range(NUM_REQUESTS) if i % 5 == 2 and i % 8 != 7)
    for i, (kind, status, text) in results:
        if kind == "malformed":
            assert status == 400, (i, status)
        elif kind == "valid":
            assert status == 200, (i, status, text)
            assert text == alone[i % 40], i
    assert rss_after - rss_before < RSS_BOUND, (rss_before, rss_after)
