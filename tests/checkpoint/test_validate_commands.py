"""Every command that reads a checkpoint refuses one that contradicts its config.json through the same
validation: calibrate, eval, generate and push exit 2 with one line naming the tensor, inputs unchanged."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.checkpoint.bad_checkpoints import CASES, spoiled
from tests.compress.synthetic import snapshot
from tests.test_cli_errors import assert_one_line_error, run_kvq_in_process

MISSING = CASES["missing-tensor"].names
COMMANDS = {
    "calibrate": lambda path: ["calibrate", str(path), "--num-samples", "1", "--seq-len", "16"],
    "eval": lambda path: ["eval", str(path), "--tasks", "text", "--limit", "1"],
    "generate": lambda path: ["generate", str(path), "hello", "--max-tokens", "1"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_commands_refuse_a_missing_tensor(tiny_checkpoint, tmp_path, command):
    path = spoiled(tiny_checkpoint("llama", "bf16"), tmp_path / "model", "missing-tensor")
    before = snapshot(path)
    assert_one_line_error(run_kvq_in_process(*COMMANDS[command](path)), str(path), MISSING)
    assert snapshot(path) == before


def test_push_refuses_an_output_whose_config_counts_more_layers(compressed, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # --dry-run: nothing is sent either way
    folder = tmp_path / "out"
    shutil.copytree(compressed("llama", "bf16"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (folder / "config.json").write_text(json.dumps(config))
    result = run_kvq_in_process("push", str(folder), "kvq-test/tiny", "--dry-run")
    assert_one_line_error(result, str(folder), "model.layers.2 is absent")
