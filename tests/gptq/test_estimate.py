"""Long layer-streamed runs say what they cost: one estimate line after the first decoder layer (time per
layer x layers), then an ETA on the layers' bar. `kvq.commands.layer_progress`, on a GPTQ run of the tiny
llama fixture and on a fake clock."""

from __future__ import annotations

import io
import re
import shutil
from pathlib import Path

from rich.console import Console

from kvq.commands.layer_progress import LayerProgress, estimate_line, format_duration
from tests.conftest import TinyCheckpoint
from tests.test_cli_errors import run_kvq_in_process

DURATION = r"(?:\d+\.\d s|\d+ min \d+ s|\d+ h \d+ min)"  # format_duration's three forms
ESTIMATE = re.compile(
    rf"^estimate: (?P<per>{DURATION}) per decoder layer x 2 layers = about {DURATION} in all "
    rf"\(1 to go: about (?P<left>{DURATION})\)$"
)


def test_gptq_prints_the_estimate_after_the_first_layer(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    src = tiny_checkpoint("llama", "bf16")
    args = ("--recipe", "w4a16-linear", "--group-size", "64", "--method", "gptq", "--num-samples", "10")
    result = run_kvq_in_process(
        "compress", str(src), str(tmp_path / "o"), *args, "--seq-len", "64", "--quiet"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    found = [i for i, line in enumerate(lines) if line.startswith("estimate:")]
    assert len(found) == 1, result.stdout
    match = ESTIMATE.match(lines[found[0]])
    assert match is not None, lines[found[0]]
    assert match["per"] != "0.0 s" and match["per"] == match["left"]  # one layer to go: one layer's time
    assert lines[0].startswith("kvq compress --method gptq:") and found[0] > 0
    assert lines[found[0] + 1].startswith("GPTQ: 14 module(s) calibrated, 2 layer(s) run")


def test_calibrate_prints_the_estimate_after_the_first_layer(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    ckpt = shutil.copytree(tiny_checkpoint("llama", "bf16"), tmp_path / "ckpt")
    result = run_kvq_in_process("calibrate", str(ckpt), "--num-samples", "2", "--seq-len", "64")
    assert result.returncode == 0, result.stderr
    found = [line for line in result.stderr.splitlines() if line.startswith("estimate:")]
    assert len(found) == 1 and ESTIMATE.match(found[0]) is not None, result.stderr


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _run(layers: list[tuple[int, float]], num_layers: int, show_bar: bool) -> list[str]:
    out = io.StringIO()
    clock = _Clock()
    progress = LayerProgress("GPTQ layers", Console(file=out, width=200), show_bar=show_bar, clock=clock)
    progress.start(num_layers)
    for i, seconds in layers:
        clock.now += seconds
        progress.layer_done(i)
    progress.stop()
    return [line for line in out.getvalue().splitlines() if line.startswith("estimate:")]


def test_one_estimate_from_the_first_layer_then_none() -> None:
    assert _run([(0, 12.0), (1, 30.0), (2, 30.0)], 30, show_bar=True) == [
        "estimate: 12.0 s per decoder layer x 30 layers = about 6 min 0 s in all (29 to go: about 5 min 48 s)"
    ]


def test_a_resumed_run_counts_the_layers_left() -> None:
    assert _run([(20, 150.0)], 30, show_bar=False) == [
        "estimate: 2 min 30 s per decoder layer x 30 layers = about 1 h 15 min in all "
        "(9 to go: about 22 min 30 s)"
    ]


def test_durations_read_as_a_person_says_them() -> None:
    assert [format_duration(s) for s in (0.04, 59.94, 61, 3599, 3600, 86399)] == [
        "0.0 s",
        "59.9 s",
        "1 min 1 s",
        "59 min 59 s",
        "1 h 0 min",
        "23 h 59 min",
    ]
    assert (
        estimate_line(1.5, 2, 0)
        == "estimate: 1.5 s per decoder layer x 2 layers = about 3.0 s in all (0 to go: about 0.0 s)"
    )
