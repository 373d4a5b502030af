"""vLLM's CPU build as `kvq bench decode`'s BF16 contender (`kvq.bench.decode_vllm`): the run in the vLLM venv
reports tok/s at both concurrencies and the ISA it ran with (opt-in: `make test-vllm`; BF16 runs on AVX2
too); a missing interpreter is a one-line error (always run)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvq.bench.decode_vllm import vllm_decode
from kvq.errors import KvqError

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(os.environ.get("KVQ_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
SETTINGS = {"threads": 1, "repeats": 1, "new_tokens": 6, "batch_seqs": 3, "batch_new_tokens": 4}


def test_a_missing_vllm_interpreter_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(
        KvqError, match=r"--vllm-python .*: no such interpreter; build the vLLM venv with make test-vllm"
    ):
        vllm_decode(tmp_path / "nope" / "python", tmp_path, [1, 2], **SETTINGS)


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON}: run `make test-vllm`")
def test_vllm_decodes_the_bf16_model_at_both_concurrencies(tiny_checkpoint) -> None:
    model = tiny_checkpoint("llama", "bf16")
    report = vllm_decode(VLLM_PYTHON, model, [5, 17, 42, 7], **SETTINGS)
    assert report["cpu_capability"] in ("AVX2", "AVX512", "DEFAULT", "ZVECTOR", "AVX512_BF16")
    assert report["vllm"].count(".") >= 1
    for key in ("c=1", "c=3"):
        assert len(report[key]) == 1 and report[key][0] > 0
