"""`/metrics`: the server's Prometheus metrics, named as vLLM's `vllm:` ones under a `kvq:` prefix.

Gauges are read when scraped (request counts, KV pages); counters and histograms are fed by the engine
thread after each step (`on_output`, `on_step`, `on_finished`) from what the step returned and the
engine's own counters (preemptions, prefix-cache hits, integrity aborts; with `--speculative`, the
proposer's `SpecStats` as vLLM's `spec_decode_*` counters), so the engine itself does no metrics work.
Per-request times (`RequestTimes`) are taken on the engine thread as outputs leave it.
Imports prometheus_client and kvq.runtime (for types).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from kvq.runtime.engine import Engine
    from kvq.runtime.outputs import RequestOutput

# vLLM's buckets (v1/metrics/loggers.py) for the same histograms
_TTFT = "0.001 0.005 0.01 0.02 0.04 0.06 0.08 0.1 0.25 0.5 0.75 1 2.5 5 7.5 10 20 40 80 160 640 2560"
_ITL = "0.01 0.025 0.05 0.075 0.1 0.15 0.2 0.3 0.4 0.5 0.75 1 2.5 5 7.5 10 20 40 80"
_LATENCY = "0.3 0.5 0.8 1 1.5 2 2.5 5 10 15 20 30 40 50 60 120 240 480 960 1920 7680"
TTFT_BUCKETS, ITL_BUCKETS, LATENCY_BUCKETS = (tuple(map(float, b.split())) for b in (_TTFT, _ITL, _LATENCY))
FINISH_REASONS = ("stop", "length", "abort", "error")
_SPEC_COUNTERS = {  # SpecStats field (vLLM's name after spec_decode_): help, as vLLM's SpecDecodingProm
    "num_drafts": "Number of spec decoding drafts.",
    "num_draft_tokens": "Number of draft tokens.",
    "num_accepted_tokens": "Number of accepted tokens.",
}


@dataclass
class RequestTimes:
    """One request's clock (time.monotonic seconds), kept by the engine thread."""

    arrival: float = field(default_factory=time.monotonic)  # when the handler submitted it
    first_output: float | None = None
    last_output: float = 0.0
    num_tokens: int = 0  # completion tokens seen so far


@dataclass
class _Delta:
    """A counter of the engine's that may start over (`Engine.reset_kv` makes a new scheduler): what it
    grew by since the last read."""

    read: Callable[[], tuple[object, int]]  # -> (the object counting, its count)
    owner: object = None
    last: int = 0

    def __call__(self) -> int:
        owner, value = self.read()
        if owner is not self.owner:
            self.owner, self.last = owner, 0
        grown, self.last = value - self.last, value
        return grown


@dataclass
class ServeMetrics:
    """The registry behind `/metrics` for one server (its own registry, so several apps can coexist)."""

    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=True))

    def __post_init__(self) -> None:
        gauge, counter = partial(Gauge, registry=self.registry), partial(Counter, registry=self.registry)
        histogram = partial(Histogram, registry=self.registry)
        self.num_requests_running = gauge("kvq:num_requests_running", "Requests with outputs, not finished.")
        self.num_requests_waiting = gauge(
            "kvq:num_requests_waiting", "Requests accepted that have no output yet."
        )
        self.kv_pages_used = gauge("kvq:kv_cache_pages_used", "KV pages held by requests.")
        self.kv_pages_total = gauge("kvq:kv_cache_pages_total", "KV pages in the pool.")
        self.kv_usage = gauge("kvq:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.prefix_queries = counter(
            "kvq:prefix_cache_queries", "Prefix cache queries, in prompt tokens admitted."
        )
        self.prefix_hits = counter(
            "kvq:prefix_cache_hits", "Prefix cache hits, in tokens found in shared pages."
        )
        self.preemptions = counter("kvq:num_preemptions", "Requests preempted (recomputed later).")
        self.integrity_aborts = counter("kvq:integrity_aborts", "Requests stopped by a failed KV page check.")
        self.prompt_tokens = counter("kvq:prompt_tokens", "Prompt tokens of requests started.")
        self.generation_tokens = counter("kvq:generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "kvq:request_success", "Finished requests by finish reason.", ["finished_reason"]
        )
        self.admission_rejections = counter(
            "kvq:admission_rejections", "Requests refused with 429 (the queue was full)."
        )
        self.ttft = histogram(
            "kvq:time_to_first_token_seconds", "Time to first token in seconds.", buckets=TTFT_BUCKETS
        )
        self.itl = histogram(
            "kvq:inter_token_latency_seconds", "Inter-token latency in seconds.", buckets=ITL_BUCKETS
        )
        self.e2e = histogram(
            "kvq:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            buckets=LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "kvq:request_queue_time_seconds",
            "Time a request waited to be scheduled.",
            buckets=LATENCY_BUCKETS,
        )
        for reason in FINISH_REASONS:
            self.request_success.labels(reason)  # every label shows from the start, at 0
        self._preemptions = _Delta(lambda: (self._engine.scheduler, self._engine.scheduler.num_preemptions))
        self._prefix_pages = _Delta(
            lambda: (self._engine.block_manager, self._engine.block_manager.num_prefix_hits)
        )
        self._aborts = _Delta(lambda: (self._engine.stats, self._engine.stats.integrity_aborts))
        self._spec_counters: list[tuple[Counter, _Delta]] = []

    def bind(self, engine: Engine, num_waiting: Callable[[], int], num_running: Callable[[], int]) -> None:
        """Read the gauges from `engine` and the request counts when scraped."""
        self._engine = engine
        self.num_requests_waiting.set_function(num_waiting)
        self.num_requests_running.set_function(num_running)
        self.kv_pages_total.set_function(lambda: engine.block_manager.num_pages)
        self.kv_pages_used.set_function(self._pages_used)
        self.kv_usage.set_function(lambda: self._pages_used() / engine.block_manager.num_pages)
        if engine.proposer is not None:
            self._bind_spec_decode(engine.config.num_speculative_tokens)
        for delta in (self._preemptions, self._prefix_pages, self._aborts, *self._spec_deltas()):
            delta()  # counts before the server started are not the server's

    def _bind_spec_decode(self, num_speculative_tokens: int) -> None:
        """vLLM's spec_decode counters (v1/spec_decode/metrics.py `SpecDecodingProm`), only when the engine
        drafts: acceptance rate = accepted / draft tokens, mean accepted length = 1 + accepted / drafts."""
        r = self.registry
        per_pos = Counter(
            "kvq:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            ["position"],
            registry=r,
        )
        for field_name, documentation in _SPEC_COUNTERS.items():
            counter = Counter(f"kvq:spec_decode_{field_name}", documentation, registry=r)
            self._spec_counters.append((counter, _Delta(partial(self._spec_count, field_name))))
        for pos in range(num_speculative_tokens):  # every position shows from the start, at 0
            self._spec_counters.append((per_pos.labels(str(pos)), _Delta(partial(self._spec_at, pos))))

    def _spec_count(self, field_name: str) -> tuple[object, int]:
        stats = self._engine.proposer.stats  # type: ignore[union-attr]
        return stats, getattr(stats, field_name)

    def _spec_at(self, pos: int) -> tuple[object, int]:
        stats = self._engine.proposer.stats  # type: ignore[union-attr]
        return stats, stats.accepted_per_pos[pos] if pos < len(stats.accepted_per_pos) else 0

    def _spec_deltas(self) -> list[_Delta]:
        return [delta for _counter, delta in self._spec_counters]

    def _pages_used(self) -> int:
        manager = self._engine.block_manager
        return manager.num_pages - manager.num_free_pages

    # -- fed by the engine thread ---------------------------------------------------------------------
    def on_output(self, times: RequestTimes, out: RequestOutput, step_start: float, now: float) -> None:
        num_new = len(out.token_ids) - times.num_tokens
        if times.first_output is None:
            times.first_output = now
            self.queue_time.observe(max(0.0, step_start - times.arrival))  # scheduled when its step began
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.prefix_queries.inc(len(out.prompt_token_ids))
            if num_new:
                self.ttft.observe(now - times.arrival)
        elif num_new:
            self.itl.observe((now - times.last_output) / num_new)
        if num_new:
            self.generation_tokens.inc(num_new)
            times.num_tokens, times.last_output = len(out.token_ids), now

    def on_step(self, engine: Engine) -> None:
        self.preemptions.inc(self._preemptions())
        self.prefix_hits.inc(self._prefix_pages() * engine.config.page_size)
        self.integrity_aborts.inc(self._aborts())
        for counter, delta in self._spec_counters:
            counter.inc(delta())

    def on_finished(self, times: RequestTimes, finish_reason: str, now: float) -> None:
        self.request_success.labels(finish_reason).inc()
        self.e2e.observe(now - times.arrival)
