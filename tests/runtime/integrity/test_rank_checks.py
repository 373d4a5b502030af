"""`--kv-integrity full` at `--tp 2` on CPU (gloo, two processes under torchrun): rank 1 checks its own
pool's pages (`kvq.runtime.integrity.ranks`). A sampled bit flipped in rank 1's copy of a sealed page is
caught before the next step reads it and ends only the request holding it, with a message naming rank 1
and the page (its pool holds `kvq plan --tp 2`'s checked bytes: its share of the heads, a whole stamp per
slot and layer); everyone else's greedy tokens, and a second run of every prompt, equal `--tp 1`'s in fp32
reference mode, on llama (GQA heads split) and the MLA fixture (the latent replicated). A late write is
skipped by every rank's write guard."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvq.checkpoint.kv_cache_spec import kv_cache_bytes, kv_cache_spec
from kvq.checkpoint.model_config import read_text_model
from tests.runtime.test_models_vs_transformers import random_prompts
from tests.runtime.tp_run import TIMEOUT_S, run

pytestmark = pytest.mark.slow
PAGE_SIZE = 4
NUM_TOKENS = 5
PROMPTS = random_prompts((9, 13, 6), seed=5)  # every prompt seals its first page at prefill
FLIP_ROW = 1


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_tp2(out: Path, **case: object) -> dict:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--master-port", str(_free_port()), "-m", "tests.runtime.integrity.tp_rank_run"]
    done = subprocess.run(
        [*torchrun, json.dumps(case), str(out)], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_a_bit_flipped_on_rank_1_ends_only_its_request(arch: str, tiny_checkpoint, tmp_path: Path) -> None:
    model = str(tiny_checkpoint(arch, "bf16"))
    expected = run(model=model, tp=1, dtype="float32", prompts=PROMPTS, num_tokens=NUM_TOKENS)["greedy"]
    case = {"model": model, "prompts": PROMPTS, "num_tokens": NUM_TOKENS, "page_size": PAGE_SIZE}
    out = tmp_path / "tp2.pt"
    faulted, clean = run_tp2(out, **case, kv_integrity="full", flip_row=FLIP_ROW)["runs"]
    rank1 = json.loads(out.with_suffix(".rank1.json").read_text())
    page, (pool_bytes, num_slots) = rank1["page"], rank1["pool"]
    spec = kv_cache_spec(read_text_model(model).fields, "")
    assert pool_bytes == kv_cache_bytes(spec, "fp32", tp=2).kvq_total(is_checked=True) * num_slots
    hit = [i for i, (_, reason, _) in enumerate(faulted) if reason == "error"]
    assert len(hit) == 1, faulted
    tokens, _, error = faulted[hit[0]]
    assert error.startswith(f"KV integrity: on tensor-parallel rank 1, page {page} (logical page 0)"), error
    assert "sampled-bytes hash" in error and error.endswith("the request was stopped"), error
    assert tokens == expected[hit[0]][: len(tokens)]  # stopped before a token from the flipped page
    for i, (tokens, reason, _) in enumerate(faulted):
        if i != hit[0]:
            assert (tokens, reason) == (expected[i], "length"), i
    assert [tokens for tokens, _, _ in clean] == expected  # the page was dropped: recomputed after


def test_a_late_write_lands_on_no_rank(tiny_checkpoint, tmp_path: Path) -> None:
    """The drill's late write (a batch re-run after its request was aborted and its pages reused) at
    --tp 2: every rank's write guard skips it, so every other request's fp32 logits equal a fault-free
    --tp 2 run's bit for bit (rank 1's unguarded writes would change them: the TP=1 guard test)."""
    out = tmp_path / "drill.pt"
    case = {"model": str(tiny_checkpoint("llama", "bf16")), "fault": "late_write"}
    argv = [sys.executable, "-m", "tests.runtime.integrity.tp_rank_run", json.dumps(case), str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    assert torch.load(out)["ok"]
