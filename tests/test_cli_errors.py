"""The CLI contract for bad input: one stderr line naming the path and problem, exit code 2, no traceback."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoint.test_reader import make_sharded


def run_kvq(*args: str) -> subprocess.CompletedProcess[str]:
    """`kvq ARGS` in a subprocess. The timeout only stops a hang: on a loaded 2-core box a kvq that starts
    a server and benches it took over 120 s (a quiet one: ~45 s)."""
    return subprocess.run([sys.executable, "-m", "kvq", *args], capture_output=True, text=True, timeout=600)


def run_kvq_in_process(*args: str) -> subprocess.CompletedProcess[str]:
    """`kvq ARGS` through the console script's own `main` in this process, stdout and stderr captured: for
    tests about what a command prints and returns, where a fresh interpreter (seconds of imports) is not
    the point. An exception `main` does not turn into a one-line error propagates and fails the test."""
    from kvq.entry import main

    out, err, argv = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = ["kvq", *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(["kvq", *args], code, out.getvalue(), err.getvalue())


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


def _kimi_with(tiny_checkpoint, tmp_path: Path, **text_fields: object) -> Path:
    """A copy of the Kimi-native fixture whose text_config carries `text_fields`."""
    import shutil

    root = Path(shutil.copytree(tiny_checkpoint("deepseek_v3", "kimi-int4"), tmp_path / "kimi"))
    config = json.loads((root / "config.json").read_text())
    config["text_config"].update(text_fields)
    (root / "config.json").write_text(json.dumps(config))
    return root


# The first case runs every command as its own process; the others run them in-process (the same `main`,
# without an interpreter start each): they differ from it only in the field the check names.
@pytest.mark.parametrize(
    "field, fragments, run",
    [
        (
            {"topk_method": "greedy"},
            ("text_config.topk_method 'greedy'", "supported topk_method: noaux_tc"),
            run_kvq,
        ),
        (
            {"scoring_func": "softmax"},
            ("text_config.scoring_func 'softmax'", "supported scoring_func: sigmoid"),
            run_kvq_in_process,
        ),
        (
            {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
            ("'dynamic'", "supported RoPE types: default, yarn"),
            run_kvq_in_process,
        ),
    ],
    ids=["topk_method", "scoring_func", "rope_scaling"],
)
def test_mla_settings_kvq_does_not_implement_are_one_line_errors(
    tiny_checkpoint, tmp_path, field, fragments, run
):
    root = _kimi_with(tiny_checkpoint, tmp_path, **field)
    assert_one_line_error(run("plan", str(root), "--tp", "2", "--gpu-mem", "8GB"), *fragments)
    assert_one_line_error(run("plan", str(root / "config.json")), *fragments)  # the bare config
    assert_one_line_error(run("calibrate", str(root), "--num-samples", "1", "--seq-len", "8"), *fragments)
    inspected = run_kvq("inspect", str(root))  # inspect reads any checkpoint and says why kvq won't run it
    assert inspected.returncode == 0 and fragments[0] in inspected.stdout.replace("\n", " ")


def test_compress_refuses_an_already_compressed_kimi_checkpoint(tiny_checkpoint, tmp_path):
    src = str(tiny_checkpoint("deepseek_v3", "kimi-int4"))
    result = run_kvq("compress", src, str(tmp_path / "out"), "--recipe", "w4a16-experts")
    assert_one_line_error(result, "already compressed-tensors output", "weight_packed")


def test_unknown_architecture_is_one_line_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "num_hidden_layers": 4}))
    assert_one_line_error(
        run_kvq("plan", str(tmp_path), "--recipe", "w4a16-experts"), "'qwen3_next'", "supported:"
    )
