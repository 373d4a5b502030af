"""`kvq generate`: streams a completion; bad input is one line on stderr and exit code 2."""

from __future__ import annotations

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


def test_generate_bad_input_is_one_line(tiny_checkpoint) -> None:
    path = str(tiny_checkpoint("llama", "bf16"))
    assert_one_line_error(run_kvq("generate", path, "hi", "--max-tokens", "0"), "max_tokens must be >= 1")
    assert_one_line_error(
        run_kvq("generate", str(tiny_checkpoint("glm_moe_dsa", "bf16")), "hi"),
        "not supported",
        "supported: glm4_moe, llama",
    )
    assert_one_line_error(
        run_kvq("generate", path, "word " * 5000, "--kv-memory", "4MiB"), "tokens but the context holds 4096"
    )
