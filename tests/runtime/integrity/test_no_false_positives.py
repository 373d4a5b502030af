"""No false positive: over 10,000 engine decode steps of a mixed workload (prefix sharing, preemption by
recompute on a small pool, page-aligned and unaligned prompts, greedy and seeded sampling, requests
arriving while others run), `full` mode (every tag check and the sampled-bytes hashes) stops nothing:
every request runs to its length and every page comes back. (That the checks change no token is shown on
the drill workload in test_faults.py.)"""

from __future__ import annotations

import random

import torch

from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.kv_layout import GqaLayout
from kvq.runtime.kv_pool import page_bytes
from kvq.runtime.request import Request
from kvq.runtime.sampling import SamplingParams

PAGE_SIZE = 4
NUM_PAGES = 48  # about four requests' worth at their longest: decode runs out of pages often
MIN_DECODE_STEPS = 10_000
MAX_WAITING = 6


def requests(seed: int) -> list[tuple[list[int], SamplingParams]]:
    """An endless-enough stream of requests: eight shared prefixes of 1-3 pages (+ up to one page of
    their own tokens), a few unshared prompts; 4-40 new tokens; a third sampled with a seed."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 2000) for _ in range(PAGE_SIZE * rng.randint(1, 3))] for _ in range(8)]
    out = []
    for i in range(5_000):
        own = [rng.randrange(3, 2000) for _ in range(rng.randint(0, PAGE_SIZE))]
        prompt = own + [7] if rng.random() < 0.15 else rng.choice(prefixes) + own
        params = SamplingParams(
            max_tokens=rng.randint(4, 40),
            temperature=0.8 if i % 3 == 0 else 0.0,
            seed=i,
            ignore_eos=True,
        )
        out.append((prompt, params))
    return out


def test_full_mode_stops_nothing_over_10k_decode_steps(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama", "bf16")
    # the tiny llama's checked pool: 2 layers, 2 KV heads of 64, and the slot stamps
    size = page_bytes(GqaLayout(2, 64, torch.float32), 2, PAGE_SIZE, is_checked=True)
    engine = Engine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            kv_memory=NUM_PAGES * size,
            page_size=PAGE_SIZE,
            max_num_seqs=8,
            decode_reserve_ratio=0.0,  # admit on prompt pages alone: decode preempts
            kv_integrity="full",
            threads=1,
        )
    )
    assert engine.kv_pool.num_pages == NUM_PAGES
    num_decode_steps, num_seq_decode_steps = 0, 0
    schedule = engine.scheduler.schedule

    def counting_schedule() -> tuple[list[Request], bool]:
        nonlocal num_decode_steps, num_seq_decode_steps
        seqs, is_prefill = schedule()
        if seqs and not is_prefill:
            num_decode_steps += 1
            num_seq_decode_steps += len(seqs)
        return seqs, is_prefill

    engine.scheduler.schedule = counting_schedule  # type: ignore[method-assign]
    pending = iter(requests(seed=0))
    finished = []
    while num_decode_steps < MIN_DECODE_STEPS or engine.has_unfinished_requests():
        while num_decode_steps < MIN_DECODE_STEPS and len(engine.scheduler.waiting) < MAX_WAITING:
            engine.add_request(*next(pending))
        finished += [out for out in engine.step() if out.finished]
    assert engine.stats.integrity_aborts == 0
    assert {out.finish_reason for out in finished} == {"length"}
    # seen: 10,055 decode steps of 75,989 sequence-decode steps, 3,716 requests, 1,405 preemptions and
    # 5,643 prefix-page hits
    assert num_decode_steps >= MIN_DECODE_STEPS and num_seq_decode_steps >= 5 * MIN_DECODE_STEPS
    assert engine.scheduler.num_preemptions >= 500
    assert engine.block_manager.num_prefix_hits >= 2_000
    assert engine.tracker is not None and engine.tracker.num_free_page_releases == 0
    assert engine.block_manager.num_free_pages == NUM_PAGES  # every page came back
