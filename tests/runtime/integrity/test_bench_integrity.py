"""`kvq bench integrity` on the tiny llama with tiny settings: the JSON holds the three modes and the
second off group with positive ratios, no aborts (the modes rotate over the engines between rounds),
the tracker's time only where a tracker exists, and a
fault drill where every fault was caught before a read and nobody else's tokens or logits changed, and
random faults that were all caught or harmless."""

from __future__ import annotations

import json
from pathlib import Path

from kvq.drill.faults import FAULTS
from tests.test_cli_errors import run_kvq


def test_bench_integrity_writes_ratios_and_a_drill(tiny_checkpoint, tmp_path: Path) -> None:
    out = tmp_path / "integrity.json"
    result = run_kvq(
        "bench", "integrity", "--model", str(tiny_checkpoint("llama", "bf16")),
        "--concurrency", "4", "--rounds", "4", "--max-tokens", "4", "--prompt-tokens", "10",
        "--shared-prefix-tokens", "4", "--threads", "1", "--kv-memory", "4MiB",
        "--random-faults", "4", "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "kvq bench integrity" in result.stdout
    data = json.loads(out.read_text())
    assert data["config"]["concurrency"] == 4 and data["config"]["rounds"] == 4
    summary = data["summary"]
    assert list(summary) == ["off", "tags", "full", "off-2"]
    for group, values in summary.items():
        assert values["tok_s"] > 0 and values["p95_step_ms"] >= values["p50_step_ms"] > 0
        assert values["tok_s_vs_off"] > 0 and values["p95_vs_off"] > 0 and values["step_vs_off"] > 0
        assert values["aborts"] == 0
        assert (values["tracker_ms_per_step"] > 0) == (group in ("tags", "full"))
        assert (
            (values["slots_per_step"] > 0)
            == (values["tracker_us_per_slot"] > 0)
            == (group in ("tags", "full"))
        )
        assert 0 <= values["tracker_share"] < 1
    off = summary["off"]
    assert off["tok_s_vs_off"] == off["p95_vs_off"] == off["step_vs_off"] == 1.0
    assert all(
        len(runs) == 4 and all(run["num_steps"] >= 4 for run in runs) for runs in data["runs"].values()
    )
    drill = data["drill"]
    assert [(row["fault"], row["mode"]) for row in drill] == [(f.name, f.mode) for f in FAULTS]
    for row in drill:
        assert row["caught"] and row["others_identical"] and not row["read_after_fault"], row
        assert row["logits_identical"] and row["pages_back"], row
    assert len(data["random_faults"]) == 4
    assert {row["outcome"] for row in data["random_faults"]} <= {"caught", "harmless"}
    assert "random faults in tags mode" in result.stdout
