"""The CLI contract for bad input: one stderr line naming the path and problem, exit code 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoint.test_reader import make_sharded


def run_kvq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvq", *args], capture_output=True, text=True, timeout=120)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert lines[0].startswith("kvq: error: ")
    for fragment in fragments:
        assert fragment in lines[0]


def _missing_shard(root: Path) -> Path:
    (root / "model-00002-of-00003.safetensors").unlink()
    return root


def _truncated(root: Path) -> Path:
    shard = root / "model-00001-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    return root


def _corrupt(root: Path) -> Path:
    shard = root / "model-00003-of-00003.safetensors"
    shard.write_bytes(b"\x00" * 4 + shard.read_bytes()[4:])
    return root


def _no_config(root: Path) -> Path:
    (root / "config.json").unlink()
    return root


def _not_checkpoint(root: Path) -> Path:
    other = root.parent / "notes"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"a": 1}))
    (other / "README.md").write_text("hello")
    return other


@pytest.mark.parametrize(
    "damage, fragments",
    [
        (_missing_shard, ("model-00002-of-00003.safetensors", "missing")),
        (_truncated, ("model-00001-of-00003.safetensors", "truncated or corrupt")),
        (_corrupt, ("model-00003-of-00003.safetensors", "truncated or corrupt")),
        (_no_config, ("config.json", "no config.json")),
        (_not_checkpoint, ("notes", "not a safetensors checkpoint")),
    ],
)
def test_inspect_bad_input(tmp_path: Path, damage, fragments: tuple[str, ...]) -> None:
    path = damage(make_sharded(tmp_path / "m"))
    assert_one_line_error(run_kvq("inspect", str(path)), *fragments)


def test_inspect_missing_directory(tmp_path: Path) -> None:
    assert_one_line_error(
        run_kvq("inspect", str(tmp_path / "nope")), str(tmp_path / "nope"), "no such directory"
    )
