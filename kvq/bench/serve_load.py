"""The load generator of `kvq bench serve`: OpenAI streaming completions against any compatible server.

`run_level(url, prompts, concurrency, ...)` sends `len(prompts)` requests, at most `concurrency` in flight,
each `stream: true` with `stream_options.include_usage` (token counts come from the server's own usage
chunk, so kvq and vLLM are counted alike) and `ignore_eos` (every request generates max_tokens). Per
request it records the time to the first token, the arrival of every text chunk and the end; `summarize`
turns them into vLLM's `benchmark_serving` measures: TTFT, TPOT = (e2e - TTFT) / (output tokens - 1),
ITL (gaps between chunks), end-to-end latency, throughput. Imports httpx only.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx

PERCENTILES = (50, 95, 99)


@dataclass
class RequestRecord:
    start: float
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


@dataclass
class LevelResult:
    """One concurrency level against one server."""

    concurrency: int
    num_requests: int
    num_failed: int
    duration_s: float
    output_tok_s: float
    total_tok_s: float
    request_s: float
    ttft_s: dict[str, float]  # "mean", "p50", "p95", "p99"
    tpot_s: dict[str, float]
    itl_s: dict[str, float]
    e2e_s: dict[str, float]
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


async def one_request(
    client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str]
) -> RequestRecord:
    record = RequestRecord(start=time.perf_counter())
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                now = time.perf_counter()
                if "error" in event:
                    record.error = str(event["error"].get("message"))
                    break
                if event.get("usage"):
                    record.prompt_tokens = event["usage"]["prompt_tokens"]
                    record.output_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        if record.ttft is None:
                            record.ttft = now - record.start
                        record.chunk_times.append(now)
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"
    record.end = time.perf_counter()
    if record.error is None and (record.ttft is None or not record.output_tokens):
        record.error = "no text or no usage chunk in the stream"
    return record


async def run_level(
    url: str,
    model: str,
    prompts: list[str],
    concurrency: int,
    max_tokens: int,
    api_key: str | None = None,
    timeout_s: float = 1800.0,
) -> list[RequestRecord]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def send(prompt: str) -> RequestRecord:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with gate:
                return await one_request(client, url, body, headers)

        return list(await asyncio.gather(*(send(p) for p in prompts)))


def served_model(url: str, api_key: str | None = None) -> str:
    """The first model a server lists at /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    reply = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    reply.raise_for_status()
    return reply.json()["data"][0]["id"]


def distribution(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    ordered = sorted(values)
    return {"mean": statistics.fmean(ordered), **{f"p{p}": percentile(ordered, p) for p in PERCENTILES}}


def percentile(ordered: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(records: list[RequestRecord], concurrency: int) -> LevelResult:
    done = [r for r in records if r.error is None]
    start = min(r.start for r in records)
    duration = max(r.end for r in records) - start
    output = sum(r.output_tokens for r in done)
    total = output + sum(r.prompt_tokens for r in done)
    tpot = [
        (r.end - r.start - r.ttft) / (r.output_tokens - 1) for r in done if r.ttft and r.output_tokens > 1
    ]
    itl = [b - a for r in done for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    return LevelResult(
        concurrency=concurrency,
        num_requests=len(records),
        num_failed=len(records) - len(done),
        duration_s=duration,
        output_tok_s=output / duration,
        total_tok_s=total / duration,
        request_s=len(done) / duration,
        ttft_s=distribution([r.ttft for r in done if r.ttft is not None]),
        tpot_s=distribution(tpot),
        itl_s=distribution(itl),
        e2e_s=distribution([r.end - r.start for r in done]),
        errors=sorted({r.error for r in records if r.error is not None})[:5],
    )
