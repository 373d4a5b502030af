"""kvq plan and kvq compress accept the same checkpoints: each spoiled checkpoint of the corpus is refused by
both before any work (exit 2, one line naming the tensor or field, no traceback), SRC byte-unchanged and
nothing written under OUT; and compress exits 1 when its closing check says --target does not load OUT."""

from __future__ import annotations

import pytest

from tests.checkpoint.bad_checkpoints import CASES, spoiled
from tests.compress.synthetic import snapshot
from tests.test_cli_errors import assert_one_line_error, run_kvq_in_process


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_and_compress_refuse_alike(tiny_checkpoint, tmp_path, case):
    src = spoiled(tiny_checkpoint("llama", "bf16"), tmp_path / "src", case)
    before = snapshot(src)
    out = tmp_path / "out"
    planned = run_kvq_in_process("plan", str(src), "--recipe", "w4a16-linear")
    compressed = run_kvq_in_process("compress", str(src), str(out), "--recipe", "w4a16-linear", "--quiet")
    for result in (planned, compressed):
        assert_one_line_error(result, str(src), CASES[case].names)
    assert planned.stderr == compressed.stderr  # one validation: the same words
    assert snapshot(src) == before
    assert not out.exists()


def test_compress_fails_when_target_does_not_load_the_output(tiny_checkpoint, tmp_path):
    # w4a16-linear quantizes the DSA indexer's weights_proj, which vLLM builds unquantized
    src, out = tiny_checkpoint("glm_moe_dsa", "fp8-block"), tmp_path / "out"
    result = run_kvq_in_process(
        "compress", str(src), str(out), "--recipe", "w4a16-linear", "--target", "vllm", "--quiet"
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert f"{out}: written, but --target vllm does not load it" in result.stderr
    assert "vllm.dense-only" in result.stdout
