"""`kvq bench serve`: the statistics are vLLM's benchmark_serving measures over recorded requests (checked
on hand-made records), and the command measures a real server given by --url next to one it starts
from --config, writing JSON whose counts match what was sent, and a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvq.bench.serve_load import RequestRecord, summarize
from kvq.bench.serve_servers import parse_servers
from kvq.errors import KvqError
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from tests.serve.conftest import running_server
from tests.test_cli_errors import run_kvq


def test_summary_of_hand_made_records() -> None:
    records = [
        RequestRecord(
            start=0.0, ttft=0.5, chunk_times=[0.5, 0.7, 1.0], end=1.0, prompt_tokens=10, output_tokens=3
        ),
        RequestRecord(start=0.2, ttft=0.3, chunk_times=[0.5, 1.5], end=2.2, prompt_tokens=6, output_tokens=5),
        RequestRecord(start=0.1, end=0.4, error="HTTP 500"),
    ]
    result = summarize(records, concurrency=2)
    assert (result.num_requests, result.num_failed, result.errors) == (3, 1, ["HTTP 500"])
    assert result.duration_s == pytest.approx(2.2)
    assert result.output_tok_s == pytest.approx(8 / 2.2) and result.total_tok_s == pytest.approx(24 / 2.2)
    assert result.request_s == pytest.approx(2 / 2.2)
    assert result.ttft_s["mean"] == pytest.approx(0.4)
    tpot = [(1.0 - 0.5) / 2, (2.0 - 0.3) / 4]  # (e2e - ttft) / (output tokens - 1)
    assert result.tpot_s["p50"] == pytest.approx(float(np.percentile(tpot, 50)))
    itl = [0.2, 0.3, 1.0]
    for p in (50, 95, 99):
        assert result.itl_s[f"p{p}"] == pytest.approx(float(np.percentile(itl, p)))
    assert result.e2e_s["p99"] == pytest.approx(float(np.percentile([1.0, 2.0], 99)))


def test_servers_are_named_by_flag() -> None:
    specs = parse_servers(["http://a:1/", "vllm=http://b:2"], [], ["x=serve --port {port}"])
    assert [(s.label, s.url, s.command) for s in specs] == [
        ("http://a:1/", "http://a:1", None),
        ("vllm", "http://b:2", None),
        ("x", None, "serve --port {port}"),
    ]
    with pytest.raises(KvqError, match="with \\{port\\} in COMMAND"):
        parse_servers([], [], ["x=serve"])
    with pytest.raises(KvqError, match="no server to measure"):
        parse_servers([], [], [])


@pytest.mark.slow
def test_bench_serve_measures_a_running_server_and_one_it_starts(tiny_checkpoint, tmp_path: Path) -> None:
    model = tiny_checkpoint("llama", "bf16")
    config = tmp_path / "tiny.yaml"
    config.write_text(
        f"model: {model}\nengine: {{kv_memory: 8MiB, threads: 1}}\nserver: {{log_level: warning}}\n"
    )
    dataset = tmp_path / "prompts.txt"
    dataset.write_text("hello world\nthe quick brown fox\none two three four\n")
    engine = Engine(EngineConfig(model=str(model), kv_memory="8MiB", threads=1))
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    with running_server(engine, model_name="tiny") as server:
        result = run_kvq(
            "bench", "serve", "--url", f"running={server.url}", "--config", str(config),
            "--concurrency", "1,4", "--num-prompts", "6", "--max-tokens", "5", "--dataset", str(dataset),
            "--json", str(out), "--plot", str(png),
        )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert list(data["servers"]) == ["running", "kvq tiny"]
    for levels in data["servers"].values():
        assert [level["concurrency"] for level in levels] == [1, 4]
        for level in levels:
            assert level["num_requests"] == 6 and level["num_failed"] == 0, level["errors"]
            assert level["output_tok_s"] * level["duration_s"] == pytest.approx(6 * 5)
            assert 0 < level["ttft_s"]["p50"] <= level["e2e_s"]["p50"] and level["tpot_s"]["p50"] > 0
    assert "kvq bench serve" in result.stdout and "TTFT p50/p95/p99" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
