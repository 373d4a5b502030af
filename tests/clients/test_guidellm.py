"""GuideLLM, the load generator vLLM's docs point to, against `kvq serve`: a short bounded run of its
default request shape (chat, streaming, `continuous_usage_stats`, `ignore_eos`) succeeds for every
request, and each request's token counts, read from the usage the server streams, are the ones asked."""

from __future__ import annotations

import pytest

from tests.clients.guidellm_runs import Load, guidellm_command, request_errors, run_guidellm
from tests.serve.conftest import Running

pytest.importorskip("guidellm")

LOAD = Load(streams=4, prompt_tokens=32, output_tokens=8, max_requests=8)


def test_short_concurrent_chat_run_has_no_errors(fp32_server: Running, smollm2, tmp_path) -> None:
    command = guidellm_command(fp32_server.url, "smollm2", smollm2.bf16, LOAD, tmp_path / "report.json")
    benchmark = run_guidellm(command, timeout_s=300)
    totals = benchmark["metrics"]["request_totals"]
    assert request_errors(benchmark) == []
    assert (totals["errored"], totals["incomplete"]) == (0, 0)
    assert totals["successful"] == LOAD.max_requests
    outputs = benchmark["metrics"]["output_token_count"]["successful"]
    assert (outputs["min"], outputs["max"]) == (LOAD.output_tokens, LOAD.output_tokens)
    prompts = benchmark["metrics"]["prompt_token_count"]["successful"]
    assert prompts["min"] >= LOAD.prompt_tokens  # the chat template adds its own tokens
