"""`kvq generate`: streams a completion; bad input is one line on stderr and exit code 2."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvq.cli import build_app
from kvq.drill.fault_injector import FaultInjector
from kvq.runtime.engine import Engine
from kvq.runtime.kernels.cpu.w4a8 import w4a8_path
from kvq.runtime.outputs import RequestOutput
from tests.runtime.kv_scales import measure_kv_scales, with_kv_scales
from tests.test_cli_errors import assert_one_line_error, run_kvq


def test_generate_streams_text_from_an_int4_checkpoint_with_fp8_kv(int4_checkpoint, tmp_path) -> None:
    source = int4_checkpoint("llama")
    path = with_kv_scales(source, tmp_path / "model", measure_kv_scales(source, [[5, 6, 7, 8] * 8]))
    result = run_kvq(
        "generate",
        str(path),
        "hello world",
        "--max-tokens",
        "12",
        "--require-kv-scales",
        "--threads",
        "1",
        "--kv-memory",
        "4MiB",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()  # the tiny random model's words
    assert "WARNING" not in result.stderr


def test_generate_without_scales_warns_loudly(tiny_checkpoint) -> None:
    result = run_kvq(
        "generate",
        str(tiny_checkpoint("llama", "bf16")),
        "hi",
        "--max-tokens",
        "2",
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--kv-memory",
        "4MiB",
    )
    assert result.returncode == 0 and "WARNING" in result.stderr and "scale 1.0" in result.stderr


def test_generate_bad_input_is_one_line(tiny_checkpoint, tmp_path) -> None:
    path = str(tiny_checkpoint("llama", "bf16"))
    assert_one_line_error(
        run_kvq("generate", path, "hi", "--max-tokens", "0"), "--max-tokens must be >= 1, got 0"
    )
    unknown = Path(shutil.copytree(path, tmp_path / "model"))
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "qwen3"}))
    assert_one_line_error(
        run_kvq("generate", str(unknown), "hi"),
        "config.json model_type is 'qwen3': not an architecture kvq (or its checks) implement",
        "supported model_type: llama, glm4_moe, glm_moe_dsa, deepseek_v3, kimi_k2",
    )
    assert_one_line_error(
        run_kvq("generate", path, "word " * 5000, "--kv-memory", "4MiB"), "tokens but the context holds 4096"
    )


def test_generate_with_kv_integrity_prints_the_same_text(tiny_checkpoint) -> None:
    path = str(tiny_checkpoint("llama", "bf16"))
    common = (
        "--max-tokens",
        "10",
        "--temperature",
        "0",
        "--kv-memory",
        "4MiB",
        "--threads",
        "1",
        "--page-size",
        "4",
    )
    off = run_kvq("generate", path, "hello world", *common)
    full = run_kvq("generate", path, "hello world", *common, "--kv-integrity", "full")
    assert off.returncode == full.returncode == 0, full.stderr
    assert full.stdout == off.stdout and full.stdout.strip()
    assert_one_line_error(
        run_kvq("generate", path, "hi", "--kv-integrity", "paranoid"), "--kv-integrity", "off, tags, full"
    )


def test_a_failed_page_check_ends_generation_with_the_message(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block-table slip injected after three steps: the text so far is printed, then one error line
    naming the page and the tags, exit code 1."""
    step, num_steps = Engine.step, [0]

    def step_with_a_slip(self: Engine) -> list[RequestOutput]:
        num_steps[0] += 1
        if num_steps[0] == 4:
            FaultInjector(self).off_by_one(self.scheduler.running[0].seq_id, 0)
        return step(self)

    monkeypatch.setattr(Engine, "step", step_with_a_slip)
    path = tiny_checkpoint("llama", "bf16")
    args = ["generate", str(path), "hello world", "--max-tokens", "12", "--temperature", "0"]
    args += ["--kv-memory", "4MiB", "--threads", "1", "--page-size", "4", "--kv-integrity", "tags"]
    result = CliRunner().invoke(build_app(), args)  # in-process: the patched step runs
    assert result.exit_code == 1, result.output
    out, err = result.stdout, result.stderr
    assert out.strip()  # the three tokens generated before the slip
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvq: error: generation stopped: KV integrity: page ")
    assert re.search(r"expected tag 0x[0-9a-f]{16}, found 0x[0-9a-f]{16}", last)


def test_generate_with_int4_compute_w4a8(int4_checkpoint) -> None:
    """The opt-in W4A8 mode from the command line: text on a SIMD CPU path, else one line saying what it
    needs (KVQ_CPU_ISA=scalar stands for a build without SIMD kernels)."""
    path = str(int4_checkpoint("llama"))
    args = ("generate", path, "hello world", "--max-tokens", "6", "--kv-memory", "4MiB", "--int4-compute")
    held = subprocess.run(
        [sys.executable, "-m", "kvq", *args, "w4a8"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "KVQ_CPU_ISA": "scalar"},
    )
    assert_one_line_error(held, "--int4-compute w4a8 needs kvq's CPU extension", "use --int4-compute w4a16")
    assert_one_line_error(run_kvq(*args, "w8a8"), "--int4-compute 'w8a8': pick one of w4a16, w4a8")
    if w4a8_path() is not None:
        result = run_kvq(*args, "w4a8")
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip()
