"""`kvq bench decode --tp 2` end to end on the tiny llama (BF16 and its INT4 output): every contender runs
at --tp 1 and --tp 2 and the JSON carries each rank's numbers: the weights it read (INT4: `kvq plan --tp
2`'s per GPU), about half of --tp 1's resident weights, half the KV bytes per token (GQA heads split) and the
same pool. Values only; nothing is timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.runtime.test_tensor_parallel import _kvq, plan_per_gpu

pytestmark = pytest.mark.slow


def test_bench_decode_at_tp2_reports_every_rank(tiny_checkpoint, compressed, tmp_path: Path) -> None:
    bf16, int4 = tiny_checkpoint("llama", "bf16"), compressed("llama", "bf16", "w4a16-linear", 32)
    out = tmp_path / "decode.json"
    args = ["bench", "decode", "--tp", "2", "--bf16", str(bf16), "--int4", str(int4), "--threads", "1"]
    args += ["--repeats", "1", "--new-tokens", "16", "--batch-seqs", "2", "--batch-new-tokens", "16"]
    done = _kvq(*args, "--json", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["tp"] == 2
    runs = {(r["contender"], r["tp"]): r for r in result["runs"]}
    names = ["kvq bf16 weights, bf16 kv", "kvq int4 weights, bf16 kv", "kvq int4 weights, fp8 kv"]
    assert sorted(runs) == sorted((name, tp) for name in names for tp in (1, 2))
    int4_per_gpu = plan_per_gpu(int4, 2)
    for name in names:
        one, two = runs[name, 1], runs[name, 2]
        assert [r["rank"] for r in one["ranks"]] == [0] and [r["rank"] for r in two["ranks"]] == [0, 1]
        read = [r["read_bytes"] for r in two["ranks"]]
        if "int4 weights" in name:
            assert read == [int4_per_gpu] * 2
        else:  # an uncompressed checkpoint: each rank reads about half (norms are read by both)
            assert read[0] == read[1] == pytest.approx(one["ranks"][0]["read_bytes"] / 2, rel=0.05)
        for rank in two["ranks"]:
            assert rank["resident_share_of_tp1"] == pytest.approx(0.5, rel=0.05), (name, rank)
            # K/V heads split over the ranks; --kv-integrity off (the bench's): no slot stamp, so exactly half
            # (a checked pool's per-rank bytes, a whole stamp per slot and layer: test_rank_checks)
            assert rank["kv_bytes_per_token"] * 2 == one["ranks"][0]["kv_bytes_per_token"]
            assert rank["kv_tokens"] == rank["kv_pages"] * result["config"]["page_size"] > 0
        assert all(r["tok_s"] > 0 and r["tok_s_batch"] > 0 for r in (one, two))
        assert len(two["tok_s_runs"]) == len(two["tok_s_batch_runs"]) == 1
