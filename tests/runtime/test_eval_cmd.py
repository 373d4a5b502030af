"""`kvq eval`: perplexity of a model and its baseline through the runtime, in a table and as JSON."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvq.cli import build_app

ARGS = ["--num-windows", "2", "--seq-len", "48", "--threads", "2", "--kv-memory", "16MiB"]


def test_model_against_its_baseline(smollm2, tmp_path) -> None:
    out = tmp_path / "eval.json"
    argv = ["eval", str(smollm2.fp8), "--baseline", str(smollm2.bf16), *ARGS, "--json", str(out)]
    result = CliRunner().invoke(build_app("eval"), argv, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    model, baseline = report["rows"]
    assert (model["format"], baseline["format"]) == ("fp8-block", "bf16")
    assert model["vs_baseline"] == pytest.approx(model["perplexity"] / baseline["perplexity"] - 1)
    assert 1 < baseline["perplexity"] < 200 and abs(model["vs_baseline"]) < 0.05  # FP8 weights: close
    assert "perplexity" in result.output and "vs baseline" in result.output


def test_a_baseline_with_another_tokenizer_is_refused(smollm2, tiny_checkpoint) -> None:
    argv = ["eval", str(smollm2.bf16), "--baseline", str(tiny_checkpoint("llama", "bf16")), *ARGS]
    result = CliRunner().invoke(build_app("eval"), argv)
    assert result.exit_code != 0 and "splits the text differently" in str(result.exception)
