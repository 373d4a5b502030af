"""`kvq generate`, `kvq serve` and `kvq eval` on MLA checkpoints (the tiny glm_moe_dsa compressed by kvq
with FP8 latent scales; Kimi K2.6's native INT4 layout under a nested kimi_k25 config): each command's
answer is the engine's own (fp32 reference mode, so another process cannot flip a token)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from typer.testing import CliRunner

from kvq.cli import build_app
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.sampling import SamplingParams
from tests.runtime.kv_scales import measure_kv_scales, with_kv_scales
from tests.serve.cli_server import kvq_serve
from tests.test_cli_errors import run_kvq

PROMPT = "the quick brown fox"


def test_generate_streams_the_engines_text_with_fp8_latent(mla_checkpoint, tmp_path: Path) -> None:
    source = mla_checkpoint("glm_moe_dsa", "int4-from-fp8-block")
    path = with_kv_scales(source, tmp_path / "model", measure_kv_scales(source, [[5, 6, 7, 8] * 8]))
    config = EngineConfig(
        model=str(path), dtype="float32", kv_cache_dtype="fp8_e4m3", require_kv_scales=True, kv_memory="4MiB"
    )
    engine = Engine(config)
    expected = engine.generate([engine.encode_chat(PROMPT)], SamplingParams(max_tokens=12))[0]
    options = [
        "--dtype",
        "float32",
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--require-kv-scales",
        "--kv-memory",
        "4MiB",
    ]
    result = run_kvq("generate", str(path), PROMPT, "--max-tokens", "12", *options, "--threads", "1")
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == expected.text + "\n" and len(expected.token_ids) == 12


def test_serve_answers_on_a_kimi_native_int4_checkpoint(mla_checkpoint) -> None:
    path = mla_checkpoint("deepseek_v3", "kimi-int4")
    engine = Engine(EngineConfig(model=str(path), dtype="float32", kv_memory="16MiB"))
    expected = engine.generate([PROMPT], SamplingParams(max_tokens=8))[0]
    options = ("--dtype", "float32", "--kv-memory", "16MiB", "--served-model-name", "kimi")
    with kvq_serve([str(path), *options]) as url:
        body = {"model": "kimi", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert reply["choices"][0]["text"] == expected.text, reply
        assert reply["usage"]["completion_tokens"] == len(expected.token_ids) > 0


def test_eval_scores_an_mla_checkpoint_against_its_source(mla_checkpoint, tmp_path: Path) -> None:
    model, baseline = mla_checkpoint("deepseek_v3", "int4-from-bf16"), mla_checkpoint("deepseek_v3", "bf16")
    out = tmp_path / "eval.json"
    args = ["--tasks", "text", "--kv-cache-dtype", "bf16", "--num-windows", "2", "--seq-len", "48"]
    args += ["--threads", "2", "--kv-memory", "16MiB"]
    argv = ["eval", str(model), "--baseline", str(baseline), *args, "--json", str(out)]
    result = CliRunner().invoke(build_app("eval"), argv, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (run,) = json.loads(out.read_text())["runs"]
    ppl = next(m for m in run["metrics"] if m["key"] == "perplexity")
    assert all(1 < ppl[k] < 10 * 2000 for k in ("model", "baseline"))  # vocabulary 2,000
    assert abs(ppl["delta"] / ppl["baseline"]) < 0.05  # INT4 experts of the same random model: close
