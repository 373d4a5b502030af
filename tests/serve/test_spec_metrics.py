"""`/metrics` with `--speculative mtp`: vLLM's `spec_decode_*` counters (under `kvq:`) move by exactly what
the engine's `SpecStats` counted for the requests, one per draft position; without `--speculative` they are
absent, as in vLLM."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from tests.serve.conftest import running_server
from tests.serve.test_metrics import moved, scrape

K = 2
COUNTS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")  # SpecStats fields, vLLM's names
PER_POS = "kvq:spec_decode_num_accepted_tokens_per_pos"
SPEC_FAMILIES = {f"kvq:spec_decode_{name}" for name in COUNTS} | {PER_POS}


def test_spec_decode_counters_are_the_engines(tiny_checkpoint) -> None:
    path = tiny_checkpoint("glm_moe_dsa", "bf16", num_mtp_layers=1)
    config = EngineConfig(
        model=str(path), dtype="float32", kv_memory="16MiB", speculative="mtp", num_speculative_tokens=K
    )
    engine = Engine(config)
    with running_server(engine, "glm") as server:
        before = scrape(server)
        assert all(before[f"{name}_total"] == 0 for name in SPEC_FAMILIES - {PER_POS})
        assert [before[f"{PER_POS}_total{{position={p}}}"] for p in range(K)] == [0] * K  # from the start
        stats = engine.proposer.stats
        counted = [getattr(stats, name) for name in COUNTS]
        for prompt in ("one two three four", "five six seven eight nine"):
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).status_code == 200
        after = scrape(server)
    grown = [moved(before, after, f"kvq:spec_decode_{name}_total") for name in COUNTS]
    assert grown == [getattr(stats, n) - c for n, c in zip(COUNTS, counted, strict=True)]
    drafts, draft_tokens, accepted = grown
    assert drafts > 0 and drafts <= draft_tokens <= K * drafts and 0 <= accepted <= draft_tokens
    per_pos = [moved(before, after, f"{PER_POS}_total{{position={p}}}") for p in range(K)]
    assert per_pos == stats.accepted_per_pos and sum(per_pos) == accepted
    assert per_pos == sorted(per_pos, reverse=True)  # a draft is kept only after every one before it
    assert drafts <= 2 * 11  # a decode step drafts once per request and emits at least one token
    engine.close()


def test_no_spec_decode_counters_without_speculative(smollm2_engine: Engine) -> None:
    with running_server(smollm2_engine) as server:
        text = httpx.get(f"{server.url}/metrics").text
    names = {family.name for family in text_string_to_metric_families(text)}
    assert "kvq:num_requests_running" in names and not names & SPEC_FAMILIES
