"""`kvq bench decode --model glm_moe_dsa --speculative mtp` on the tiny fixture: the report carries every
contender with consistent values (acceptance in [0, 1], mean accepted length in [1, K + 1], fewer target
forwards per token when drafts are accepted), and the fitted MTP head is accepted where the random one is
not. Values only; the speeds are whatever the machine gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvq.bench.decode_spec import PLAIN, SpecBenchConfig, render_spec, run_spec_bench, spec_models
from kvq.bench.json_output import write_json
from kvq.cli import build_app

K = 2


def test_report_is_consistent(tmp_path: Path) -> None:
    config = SpecBenchConfig(
        threads=1, repeats=1, new_tokens=10, num_speculative_tokens=K, prompt_tokens=12, fit_steps=150
    )
    result = run_spec_bench(config, spec_models(config, tmp_path, size="tiny"))
    random, fitted = (f"mtp K={K}, {kind} MTP layer" for kind in ("random", "fitted"))
    assert list(result.runs) == [PLAIN, random, fitted]
    plain = result.runs[PLAIN]
    assert plain.speedup == 1.0 and plain.target_forwards_per_token == 1.0 and plain.accepted_per_pos == []
    assert plain.target_forward_ms > 0 and plain.mtp_ms == 0.0
    for name in (random, fitted):
        run = result.runs[name]
        assert run.tok_s > 0 and run.speedup == pytest.approx(run.tok_s / plain.tok_s)
        assert run.target_forward_ms > 0 and run.mtp_ms > 0 and len(run.tok_s_runs) == 1
        assert 0.0 <= run.acceptance_rate <= 1.0 and 1.0 <= run.mean_accepted_length <= K + 1
        assert len(run.accepted_per_pos) == K and run.accepted_per_pos == sorted(run.accepted_per_pos)[::-1]
        # one prefill, then one verification per (1 + accepted) tokens
        assert run.target_forwards_per_token <= 1.0
    assert result.runs[fitted].acceptance_rate > 0.5 > result.runs[random].acceptance_rate
    assert result.runs[fitted].target_forwards_per_token < 0.75
    out = tmp_path / "spec.json"
    write_json(result, out)
    assert json.loads(out.read_text())["runs"][fitted]["mean_accepted_length"] > 1.5
    assert render_spec(result).row_count == 3


def test_speculative_needs_the_mla_bench() -> None:
    done = CliRunner().invoke(build_app(), ["bench", "decode", "--speculative", "mtp"])
    assert done.exit_code != 0 and "--model glm_moe_dsa" in str(done.exception)
