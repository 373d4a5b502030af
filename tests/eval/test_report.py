"""The report's text: which engine computed it, and a served run's rows (a KL lower bound named with its N,
a metric lm-eval does not average shown without an interval)."""

from __future__ import annotations

from kvq.eval.report import engine_line, markdown_tables, metric_rows


def test_engine_line_names_the_runtime_or_each_server() -> None:
    assert engine_line({"engine": {"name": "kvq runtime", "version": "0.1.0"}}) == "kvq runtime 0.1.0"
    servers = {"model": {"name": "vllm", "version": "0.32.0"}, "baseline": {"name": "kvq", "version": None}}
    assert engine_line({"engine": {"name": "server", "servers": servers}}) == (
        "model: vllm 0.32.0; baseline: kvq (version not reported)"
    )


def test_served_rows() -> None:
    kl = {"key": "kl", "name": "KL(baseline ‖ model), lower bound from the top-20 prompt log-probabilities"}
    kl |= {"unit": "nats", "model": 0.01234, "model_ci95": [0.01, 0.015], "ci95": [0.01, 0.015]}
    bleu = {"key": "t/bleu,none", "name": "t bleu v1.0", "unit": "score", "model": 25.0, "model_ci95": None}
    bleu |= {"baseline": 26.0, "delta": -1.0, "ci95": None}
    run = {"checkpoint": "model", "kv_cache": "as served", "metrics": [kl, bleu]}
    assert metric_rows(run) == [
        (kl["name"], "", "0.0123", "", "[0.0100, 0.0150]"),
        ("t bleu v1.0", "26.0000", "25.0000", "-1.0000", ""),
    ]
    report = {"model": {"path": "int4", "format": "served by vllm"}, "runs": [run]}
    report["baseline"] = {"path": "bf16", "format": "served by vllm", "kv_cache": "as served"}
    assert markdown_tables(report).startswith("**int4 (served by vllm, KV as served) vs bf16 (served by vllm")
