"""The dtype of GPTQ's calibration forward: auto asks the CPU once (float32 without native bf16), bfloat16
stays llm-compressor's path byte for byte, float32 changes only a few codes; bad values are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvq.calibrate.calibration_config import CalibrationConfig
from kvq.checkpoint.reader import Checkpoint
from kvq.compress.manifest import read_manifest
from kvq.compress.recipe import load_recipe
from kvq.errors import KvqError
from kvq.gptq import forward_dtype
from kvq.gptq.forward_dtype import CpuBf16, detect_cpu_bf16, resolve_forward_dtype
from kvq.gptq.gptq_config import GptqConfig
from kvq.gptq.gptq_job import prepare_gptq, run_gptq
from tests.conftest import TinyCheckpoint
from tests.test_cli_errors import assert_one_line_error, run_kvq, run_kvq_in_process

AVX2 = CpuBf16(is_native=False, facts="no avx512_bf16 or amx_bf16; torch AVX2")
ZEN4 = CpuBf16(is_native=True, facts="avx512_bf16; torch AVX512")
ARGS = ("--recipe", "w4a16-linear", "--group-size", "64", "--method", "gptq", "--num-samples", "10")
ARGS += ("--seq-len", "64", "--workers", "1", "--quiet")


def test_auto_picks_float32_without_native_bf16() -> None:
    assert resolve_forward_dtype("auto", AVX2).dtype == "float32"
    assert "no native bf16" in resolve_forward_dtype("auto", AVX2).reason
    assert resolve_forward_dtype("auto", ZEN4).dtype == "bfloat16"


def test_a_given_dtype_is_kept_whatever_the_cpu() -> None:
    assert resolve_forward_dtype("bfloat16", AVX2).dtype == "bfloat16"
    assert resolve_forward_dtype("float32", ZEN4).dtype == "float32"
    with pytest.raises(KvqError, match="--gptq-forward-dtype 'fp16' is unknown; use one of auto"):
        resolve_forward_dtype("fp16", ZEN4)


def test_a_onednn_cap_below_bf16_means_no_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    cpu = detect_cpu_bf16()
    assert not cpu.is_native and "ONEDNN_MAX_CPU_ISA=AVX2" in cpu.facts


def _packed(root: Path) -> dict[str, bytes]:
    ckpt = Checkpoint.open(root)
    return {n: ckpt.read(n).numpy().tobytes() for n in sorted(ckpt.tensors) if n.endswith(".weight_packed")}


def _cli(src: Path, out: Path, *extra: str, cpu: CpuBf16, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(forward_dtype, "detect_cpu_bf16", lambda: cpu)  # the ISA answer auto gets
    result = run_kvq_in_process("compress", str(src), str(out), *ARGS, *extra)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_auto_on_an_avx2_cpu_runs_float32_and_bfloat16_stays_the_oracle_path(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tiny_checkpoint("llama", "bf16")
    auto = _cli(src, tmp_path / "auto", cpu=AVX2, monkeypatch=monkeypatch)
    assert "forward float32 (auto: no native bf16 arithmetic" in auto
    assert read_manifest(tmp_path / "auto")["job"]["method"]["options"]["dtype"] == "float32"
    exact = _cli(
        src, tmp_path / "bf16", "--gptq-forward-dtype", "bfloat16", cpu=AVX2, monkeypatch=monkeypatch
    )
    assert "forward bfloat16 (--gptq-forward-dtype bfloat16)" in exact
    # the library's default config is what tests/gptq/test_oracle.py holds equal to llm-compressor
    job = prepare_gptq(
        src,
        tmp_path / "lib",
        load_recipe("w4a16-linear", 64),
        GptqConfig(CalibrationConfig(num_samples=10, seq_len=64)),
    )
    run_gptq(job, workers=1)
    oracle, bf16, fp32 = _packed(tmp_path / "lib"), _packed(tmp_path / "bf16"), _packed(tmp_path / "auto")
    assert len(oracle) == 14 and bf16 == oracle
    assert fp32.keys() == oracle.keys() and fp32 != oracle  # other Hessians, so GPTQ picks other codes
    mine, theirs = Checkpoint.open(tmp_path / "auto"), Checkpoint.open(tmp_path / "lib")
    for name in oracle:  # group scales come from the original weights, whatever the forward
        scale = name.replace("weight_packed", "weight_scale")
        assert torch.equal(mine.read(scale), theirs.read(scale)), scale


def test_bad_forward_dtype_and_rtn_are_refused(tiny_checkpoint: TinyCheckpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint("llama", "bf16")
    result = run_kvq("compress", str(src), str(tmp_path / "o"), *ARGS, "--gptq-forward-dtype", "fp16")
    assert_one_line_error(result, "--gptq-forward-dtype 'fp16' is unknown", "auto, bfloat16, float32")
    result = run_kvq(
        "compress",
        str(src),
        str(tmp_path / "o"),
        "--recipe",
        "w4a16-linear",
        "--gptq-forward-dtype",
        "float32",
    )
    assert_one_line_error(result, "--gptq-forward-dtype only apply to --method gptq")
    assert not (tmp_path / "o").exists()
