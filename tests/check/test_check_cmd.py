"""`kvq check` on the command line, and `kvq compress` printing its verdict after writing."""

from __future__ import annotations

import json

import pytest

from tests.test_cli_errors import assert_one_line_error, run_kvq


def test_check_exit_codes_and_json(compressed):
    out = compressed("glm4_moe", "fp8-block")  # vllm target: vLLM loads it at tp 1, SGLang main does not
    ok = run_kvq("check", str(out), "--engine", "vllm", "--engine", "transformers")
    assert ok.returncode == 0, ok.stderr
    assert "vllm (tp 1): loads" in ok.stdout and "transformers (tp 1): loads" in ok.stdout
    refused = run_kvq("check", str(out), "--engine", "sglang", "--json")
    assert refused.returncode == 1
    [sglang] = json.loads(refused.stdout)["engines"]
    assert not sglang["loads"] and "sglang.moe-format" in {f["rule"] for f in sglang["findings"]}


@pytest.mark.parametrize(
    ("args", "fragment"),
    [(["--engine", "tgi"], "--engine 'tgi' is not known"), (["--tp", "0"], "--tp 0")],
)
def test_bad_flags(compressed, args, fragment):
    assert_one_line_error(run_kvq("check", str(compressed("llama", "bf16", "w4a16-linear")), *args), fragment)


@pytest.mark.slow
def test_compress_lists_bf16_tensors_and_prints_the_check(tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    src = tiny_checkpoint("glm4_moe", "fp8-block")
    result = run_kvq(
        "compress", str(src), str(out), "--recipe", "w4a16-experts", "--target", "sglang", "--quiet"
    )
    assert result.returncode == 0, result.stderr
    assert "FP8-block written as BF16 (" in result.stdout and "target sglang: SGLang main" in result.stdout
    assert f"kvq check: {out}" in result.stdout and "sglang (tp 1): loads" in result.stdout
    manifest = json.loads((out / "kvq_manifest.json").read_text())
    assert manifest["target"] == "sglang" and manifest["job"]["target"] == "sglang"
    assert "model.layers.0.self_attn.q_proj.weight" in {
        d["name"] for d in manifest["fp8_dequantized_to_bf16"]
    }
    other = run_kvq("compress", str(src), str(out), "--recipe", "w4a16-experts", "--quiet")
    assert_one_line_error(other, "already holds a different job", "target sglang")
