"""A calibration lands whole or not at all: failed at any of its file operations (`KVQ_WRITE_FAULT`), the
checkpoint is byte-identical to before and a re-run completes it; killed half way, the next run rolls
back first; an unwritable checkpoint is refused before any work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvq.calibrate.calibrate_checkpoint import calibrate
from kvq.calibrate.calibration_config import CalibrationConfig
from kvq.calibrate.scales_record import UNIT_FILES
from kvq.checkpoint.file_commit import FAULT_ENV, recover
from kvq.errors import KvqError
from tests.calibrate.conftest import writable
from tests.conftest import TinyCheckpoint

SETTINGS = {"num_samples": 2, "seq_len": 32}  # and a small text file: the bundled articles load slowly
# the tiny llama has an index and a config, no manifest: 4 staged writes, the journal, 2 originals kept,
# 4 renames
NUM_OPERATIONS = 11


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> CalibrationConfig:
    import json

    from kvq.data.texts import load_texts

    path = tmp_path_factory.mktemp("texts") / "texts.jsonl"
    path.write_text(
        "".join(json.dumps({"text": t[:2000]}) + "\n" for t in load_texts(None, "calibration")[:2])
    )
    return CalibrationConfig(dataset=path, **SETTINGS)


@pytest.fixture(scope="module")
def calibrated(
    tiny_checkpoint: TinyCheckpoint, tmp_path_factory: pytest.TempPathFactory, settings: CalibrationConfig
) -> dict[str, bytes]:
    """The files of the tiny llama after one uninterrupted calibration."""
    root = writable(tiny_checkpoint("llama", "bf16"), tmp_path_factory.mktemp("calibrated"))
    calibrate(root, settings)
    return files(root)


@pytest.fixture
def root(tiny_checkpoint: TinyCheckpoint, tmp_path: Path) -> Path:
    """A private copy of the tiny llama."""
    return writable(tiny_checkpoint("llama", "bf16"), tmp_path)


@pytest.mark.parametrize("at", range(1, NUM_OPERATIONS + 1))
def test_a_failure_at_any_write_changes_nothing_and_a_rerun_completes(
    root: Path, monkeypatch, settings, calibrated, at: int
) -> None:
    before = files(root)
    monkeypatch.setenv(FAULT_ENV, str(at))
    with pytest.raises(KvqError, match=f"{root}: failed .*injected fault.*; nothing was changed"):
        calibrate(root, settings)
    assert files(root) == before
    monkeypatch.delenv(FAULT_ENV)
    calibrate(root, settings)
    assert files(root) == calibrated


def test_no_operation_past_the_last_one(root: Path, monkeypatch, settings, calibrated) -> None:
    monkeypatch.setenv(FAULT_ENV, str(NUM_OPERATIONS + 1))
    calibrate(root, settings)
    assert files(root) == calibrated


def test_a_kill_between_renames_is_rolled_back_by_the_next_run(root: Path, settings, calibrated) -> None:
    before = files(root)
    env = {**os.environ, FAULT_ENV: "10:kill"}  # scales and index renamed, config.json not yet
    argv = [sys.executable, "-m", "kvq", "calibrate", str(root), "--dataset", str(settings.dataset)]
    argv += ["--num-samples", "2", "--seq-len", "32"]
    killed = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr
    assert files(root) != before  # half there: what a kill leaves, journal included
    recover(root, UNIT_FILES)  # what the next run does first
    assert files(root) == before
    calibrate(root, settings)
    assert files(root) == calibrated


def test_an_unwritable_checkpoint_is_refused_before_any_work(root: Path, monkeypatch, settings) -> None:
    before = files(root)

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    def no_work(*args, **kwargs):
        raise AssertionError("calibration started on a checkpoint it cannot write")

    monkeypatch.setattr("kvq.checkpoint.writable.tempfile.mkstemp", read_only)
    monkeypatch.setattr("kvq.calibrate.calibrate_checkpoint.calibration_samples", no_work)
    with pytest.raises(KvqError, match=f"{root}: cannot write in {root} \\(Permission denied\\)"):
        calibrate(root, settings)
    assert files(root) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_checkpoint_is_refused(root: Path, settings) -> None:
    root.chmod(0o555)
    try:
        with pytest.raises(KvqError, match="cannot write in"):
            calibrate(root, settings)
    finally:
        root.chmod(0o755)
