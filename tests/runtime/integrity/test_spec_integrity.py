"""`--speculative mtp` with `--kv-integrity tags/full`: fp32 greedy output is the output without speculation
(prefix sharing with pages of 4, forced preemption, `--tp 2`: every rank's stamps follow rank 0's across
rollbacks), no request is stopped, every page goes back to the pool after rolled-back drafts, and a
rejected draft's slot read later (a slip that counts it as accepted) stops exactly its request.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.request import Status
from kvq.runtime.sampling import SamplingParams
from tests.runtime.reference import engine_greedy
from tests.runtime.test_mla_vs_transformers import engine_with_pages, shared_prefix_prompts

NUM_TOKENS = 20


def plain_greedy(path: Path, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    engine = Engine(EngineConfig(model=str(path), dtype="float32", kv_memory="16MiB"))
    return engine_greedy(engine, prompts, num_tokens)


def spec_engine(path: Path, k: int, mode: str = "tags", **kwargs) -> Engine:
    spec = {"speculative": "mtp", "num_speculative_tokens": k}
    return Engine(EngineConfig(model=str(path), dtype="float32", kv_integrity=mode, **spec, **kwargs))


def assert_clean(engine: Engine) -> None:
    assert engine.stats.integrity_aborts == 0
    tracker = engine.tracker
    assert tracker is not None and not tracker.faults and not tracker.holdings
    assert tracker.num_repairs == tracker.num_free_page_releases == 0
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages  # drafts' pages back


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v3"])
def test_greedy_with_tags_is_the_models_own(tiny_checkpoint, arch: str) -> None:
    path = tiny_checkpoint(arch, "bf16", num_mtp_layers=1)
    prompts = shared_prefix_prompts()
    expected = plain_greedy(path, prompts, NUM_TOKENS)
    for k in (1, 3):
        engine = spec_engine(path, k, kv_memory="16MiB", page_size=4)
        assert engine_greedy(engine, prompts, NUM_TOKENS) == expected
        assert engine.proposer is not None and engine.proposer.stats.num_draft_tokens > 0
        assert engine.block_manager.num_prefix_hits >= 5  # the shared prompt pages
        assert_clean(engine)


def test_greedy_with_full_is_the_models_own(tiny_checkpoint) -> None:
    path = tiny_checkpoint("glm_moe_dsa", "bf16", num_mtp_layers=1)
    prompts = shared_prefix_prompts()
    engine = spec_engine(path, 2, "full", kv_memory="16MiB", page_size=4)
    assert engine_greedy(engine, prompts, NUM_TOKENS) == plain_greedy(path, prompts, NUM_TOKENS)
    assert_clean(engine)


def test_greedy_with_tags_and_forced_preemption(tiny_checkpoint) -> None:
    path = tiny_checkpoint("glm_moe_dsa", "bf16", num_mtp_layers=1)
    prompts = shared_prefix_prompts()
    expected = plain_greedy(path, prompts, 32)
    tight = engine_with_pages(
        path, 24, decode_reserve_ratio=0.0, speculative="mtp", num_speculative_tokens=2, kv_integrity="tags"
    )
    assert engine_greedy(tight, prompts, 32) == expected
    assert tight.scheduler.num_preemptions > 0
    assert_clean(tight)


def test_a_rejected_drafts_slot_read_later_is_caught(tiny_checkpoint) -> None:
    """After a verification that rejected drafts, the request is slipped one token: its rejected draft at
    its last position is counted as accepted without being rewritten. The next step reads that slot: its
    stamp still carries the draft mark, so the request is stopped; the other finishes as without the slip."""
    path = tiny_checkpoint("glm_moe_dsa", "bf16", num_mtp_layers=1)
    prompts = shared_prefix_prompts()[2:4]
    expected = plain_greedy(path, prompts, NUM_TOKENS)
    engine = spec_engine(path, 3, kv_memory="16MiB", page_size=4)
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    engine.step()  # the prefill (and the MTP layer's first drafts)
    engine.step()  # a verification: the random MTP layer's drafts are rejected
    victim = next(s for s in engine.scheduler.running if s.seq_id == ids[0])
    assert victim.status is Status.RUNNING
    victim.token_ids.append(victim.token_ids[-1])  # the slip: one more token, its K/V never written
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final[ids[0]].finish_reason == "error" and "stamp" in (final[ids[0]].error or "")
    assert final[ids[1]].token_ids == expected[1]
    assert engine.stats.integrity_aborts == 1
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


TP_SCRIPT = """
import json, sys
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.sampling import SamplingParams
spec = sys.argv[3] or None
e = Engine(EngineConfig(model=sys.argv[1], tp=int(sys.argv[2]), dtype="float32", kv_memory="4MiB", threads=1,
    page_size=4, speculative=spec, num_speculative_tokens=3, kv_integrity="tags" if spec else "off"))
outs = e.generate(json.loads(sys.argv[4]), SamplingParams(max_tokens=16, ignore_eos=True))
accepted = e.proposer.stats.num_accepted_tokens if e.proposer else 0
print(json.dumps([[o.token_ids for o in outs], e.stats.integrity_aborts, accepted]))
e.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v3"])
def test_tp2_with_tags_is_tp1s_greedy(tiny_checkpoint, tmp_path: Path, arch: str) -> None:
    """At --tp 2 the ranks past 0 check their own pools' stamps: accepted drafts' stamps, rewritten on rank 0,
    travel to them, so no request is stopped and the output is --tp 1's without speculation. The MTP layer
    is fitted so that drafts are accepted (a random one's are not, and no stamp is rewritten)."""
    from kvq.fixtures.mtp_fit import build_predictive_mtp

    prompts = [[1, 5, 9, 200, 33, 7, 8, 9, 10, 11, 12, 13][: 5 + 3 * i] for i in range(3)]
    source = tiny_checkpoint(arch, "bf16", num_mtp_layers=1)
    path = build_predictive_mtp(source, tmp_path / "fit", prompts, 16, steps=150)

    def run(tp: int, spec: str) -> list:
        args = [sys.executable, "-c", TP_SCRIPT, str(path), str(tp), spec, json.dumps(prompts)]
        done = subprocess.run(args, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    outputs, aborts, accepted = run(2, "mtp")
    assert aborts == 0 and accepted >= 16
    assert outputs == run(1, "")[0]
