"""`--tp 2` on CPU (gloo, two processes kvq starts itself): the same greedy tokens as one process in
fp32 reference mode on llama, glm4_moe and the MLA models; the fast path (bf16, INT4) within TP=1's logit
tolerances of transformers' fp32 forward; each rank reads exactly `kvq plan --tp 2`'s weights per GPU
and holds about half of TP=1's (MLA: plus its replicated latent projections); a checkpoint that does not
split on group boundaries is a one-line error naming the tensor; a rank killed mid-run ends the server
with an error naming it, in bounded time.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from tests.runtime.reference import hf_greedy, hf_logits, hf_reference
from tests.runtime.test_models_vs_transformers import random_prompts
from tests.runtime.tp_run import run, run_in_process
from tests.test_cli_errors import assert_one_line_error, run_kvq_in_process

pytestmark = pytest.mark.slow
NUM_TOKENS = 12
# the prompts outgrow the tiny GLM-5's index_topk (8): its DSA selection is sparse
PROMPTS = random_prompts((5, 14), seed=3)


def plan_per_gpu(path: Path, tp: int) -> int:
    result = run_kvq_in_process("plan", str(path), "--tp", str(tp), "--gpu-mem", "1GiB", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["serving"]["weight_bytes_per_gpu"]


@pytest.mark.parametrize("arch", ["llama", "glm4_moe", "glm_moe_dsa", "deepseek_v3"])
def test_reference_mode_greedy_at_tp2_is_tp1s(arch: str, tiny_checkpoint, tmp_path: Path) -> None:
    case = {"model": str(tiny_checkpoint(arch, "bf16")), "dtype": "float32", "prompts": PROMPTS}
    one = run(tp=1, num_tokens=NUM_TOKENS, **case)  # type: ignore[arg-type]
    two = run_in_process(tmp_path / "tp2.pt", tp=2, num_tokens=NUM_TOKENS, **case)
    assert two["greedy"] == one["greedy"]
    scores = torch.tensor(two["prompt_logprobs"]), torch.tensor(one["prompt_logprobs"])
    torch.testing.assert_close(*scores, atol=1e-4, rtol=0)  # every rank joins the prompt's lm_head chunks
    rank0, rank1 = two["weight_bytes"]
    assert rank0 == rank1
    half = one["weight_bytes"][0] / 2
    if arch in ("llama", "glm4_moe"):  # everything but norms and the router splits
        assert abs(rank0 / half - 1) < 0.05, (rank0, half)
    else:  # q_a_proj / kv_a_proj_with_mqa (and the indexer) replicated on both ranks
        assert half < rank0 < 1.3 * half, (rank0, half)


# llama all-INT4 at group 32 (its 576-wide MLP gives each rank 288 columns: whole groups of 32, not 64)
FAST = [
    ("llama", "w4a16-linear", 32),
    ("glm4_moe", "w4a16-experts", 64),
    ("deepseek_v3", "w4a16-experts", 64),
]


@pytest.mark.parametrize(("arch", "recipe", "group_size"), FAST, ids=[a for a, _, _ in FAST])
def test_fast_path_at_tp2_within_tp1_tolerances(
    arch: str, recipe: str, group_size: int, compressed, tmp_path: Path
) -> None:
    path = compressed(arch, "bf16", recipe, group_size)
    hf = hf_reference(path)
    prompts = random_prompts((20, 33), seed=2)
    forced = [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]
    expected = [hf_logits(hf, p + f)[len(p) - 1 :] for p, f in zip(prompts, forced, strict=True)]
    case = {"model": str(path), "dtype": "auto", "prompts": prompts, "num_tokens": 2, "forced": forced}
    two = run_in_process(tmp_path / "tp2.pt", tp=2, **case)
    # test_models_vs_transformers' bounds for TP=1 with bf16 pages
    errors = [(f - e).abs().amax(-1) / e.std() for f, e in zip(two["logits"], expected, strict=True)]
    agreement = [
        (f.argmax(-1) == e.argmax(-1)).float().mean() for f, e in zip(two["logits"], expected, strict=True)
    ]
    all_errors = torch.cat(errors)
    assert all_errors.median() < 0.06 and (all_errors < 1.0).float().mean() > 0.85, all_errors
    assert sum(agreement) / len(agreement) > 0.75, agreement
    # the weights each rank reads are what `kvq plan --tp 2` puts on each GPU, to the byte
    assert two["read_bytes"] == [plan_per_gpu(path, 2)] * 2
    tp1 = run(model=str(path), tp=1, dtype="auto", prompts=prompts[:1], num_tokens=1)
    half = tp1["weight_bytes"][0] / 2
    assert tp1["read_bytes"] == [plan_per_gpu(path, 1)]
    if arch != "deepseek_v3":
        assert abs(two["weight_bytes"][0] / half - 1) < 0.05, (two["weight_bytes"], half)


def test_a_split_off_group_boundaries_is_one_line(compressed) -> None:
    path = compressed("llama", "bf16", "w4a16-linear", 64)  # 576 / 2 = 288 columns: not whole groups of 64
    result = _kvq("generate", str(path), "hi", "--tp", "2", "--max-tokens", "2", "--kv-memory", "4MiB")
    assert_one_line_error(
        result, "model.layers.0.mlp.down_proj.weight_packed columns (576, group size 64)", "pick a --tp"
    )


def _kvq(*args: str) -> subprocess.CompletedProcess[str]:
    """`kvq ARGS` with a timeout for two ranks starting on a loaded 2-core machine (run_kvq's is 120 s)."""
    return subprocess.run([sys.executable, "-m", "kvq", *args], capture_output=True, text=True, timeout=600)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            httpx.get(f"{url}/health", timeout=5)
            return
        except httpx.TransportError:
            time.sleep(0.5)
    raise AssertionError(f"kvq serve --tp 2 was not up after {timeout_s} s")


def _rank_processes(server: subprocess.Popen) -> list[psutil.Process]:
    children = psutil.Process(server.pid).children()
    return [p for p in children if "kvq.runtime.distributed.worker" in " ".join(p.cmdline())]


def test_a_rank_killed_mid_run_ends_the_server_with_an_error(tiny_checkpoint, tmp_path: Path) -> None:
    """SIGKILL rank 1 while a request streams: rank 0 says which rank died and exits non-zero, in
    bounded time (the watchdog), and leaves no rank behind."""
    port = _free_port()
    argv = [sys.executable, "-m", "kvq", "serve", str(tiny_checkpoint("llama", "bf16")), "--tp", "2"]
    argv += ["--port", str(port), "--kv-memory", "4MiB", "--threads", "1"]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, server, timeout_s=300)
        (rank1,) = _rank_processes(server)
        body = {"prompt": "hello", "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # decoding has begun
            rank1.kill()
            with contextlib.suppress(httpx.HTTPError):
                for _ in lines:  # the stream ends (an error event, or the connection drops)
                    pass
        assert server.wait(timeout=60) != 0
        stderr = server.stderr.read() if server.stderr else ""
        assert f"tensor-parallel rank 1 (pid {rank1.pid}) was killed by signal 9" in stderr, stderr
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)


def test_under_torchrun_the_text_is_one_process_s(tiny_checkpoint) -> None:
    """torchrun starts both ranks (RANK / WORLD_SIZE / MASTER_* set): rank 0 prints, rank 1 only computes."""
    args = ["generate", str(tiny_checkpoint("llama", "bf16")), "hello", "--max-tokens", "8"]
    args += ["--dtype", "float32", "--kv-memory", "4MiB", "--threads", "1"]
    one = _kvq(*args)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--master-port", str(_free_port()), "-m", "kvq", *args, "--tp", "2"]
    two = subprocess.run(torchrun, capture_output=True, text=True, timeout=600)
    assert one.returncode == two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and one.stdout.strip()


def test_eval_at_tp2_scores_as_tp1_twice_in_one_process(tiny_checkpoint, tmp_path: Path) -> None:
    """`kvq eval --tp 2` builds MODEL's --tp 2 engines one after the other (ranks stopped and restarted),
    beside the baseline's --tp 1 engine: every run scores as at --tp 1."""
    path = str(tiny_checkpoint("llama", "bf16"))
    args = ["eval", path, "--baseline", path, "--tasks", "text", "--kv-cache-dtype", "bf16,auto"]
    args += ["--num-windows", "2", "--seq-len", "32", "--kv-memory", "4MiB"]
    args += ["--dtype", "float32", "--baseline-dtype", "float32"]
    one = run_kvq_in_process(*args, "--json", str(tmp_path / "one.json"))  # --tp 1 needs no process
    two = _kvq(*args, "--tp", "2", "--json", str(tmp_path / "two.json"))
    assert one.returncode == two.returncode == 0, two.stderr

    def perplexities(name: str) -> list[float]:
        runs = json.loads((tmp_path / name).read_text())["runs"]
        return [m["model"] for run in runs for m in run["metrics"] if m["key"] == "perplexity"]

    expected = perplexities("one.json")
    assert len(expected) == 2 and perplexities("two.json") == pytest.approx(expected, rel=1e-5)
