"""The abort path: a hit request ends with an error and gives back exactly the pages it was given (not
what its wrong block table names); pages it sealed but will never write leave the prefix cache, and a
request that attached one in the same prefill is requeued, not failed."""

from __future__ import annotations

import torch

from kvq.runtime.block_manager import BlockManager
from kvq.runtime.integrity.abort import remove_hit
from kvq.runtime.integrity.tracker import TagTracker
from kvq.runtime.model_runner import StepBatches
from kvq.runtime.request import Request, Status
from kvq.runtime.sampling import SamplingParams
from kvq.runtime.scheduler import Scheduler

P = 4
NUM_PAGES = 8


def request(seq_id: int, token_ids: list[int]) -> Request:
    return Request(seq_id, token_ids, len(token_ids), SamplingParams(max_tokens=4), len(token_ids) + 4)


def test_a_hit_prefill_requeues_who_shares_its_unwritten_pages() -> None:
    tracker = TagTracker(NUM_PAGES, P, torch.device("cpu"))
    manager = BlockManager(NUM_PAGES, P, tracker=tracker)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64, decode_reserve_ratio=0.0)
    x = request(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    y = request(1, [1, 2, 3, 4, 5, 6, 7, 8, 10, 11])
    z = request(2, [30, 31, 32])
    for s in (x, y, z):
        scheduler.add(s)
    seqs, is_prefill = scheduler.schedule()
    assert seqs == [x, y, z] and is_prefill
    assert y.block_table[:2] == x.block_table[:2]  # sealed by x this step, its K/V not yet written
    x_own_last, y_last = x.block_table[2], y.block_table[2]
    x.block_table[2] = y_last  # an off-by-one slip: x would read and write y's page
    runner = StepBatches(P, NUM_PAGES, 1, torch.device("cpu"))
    mismatches = tracker.check(seqs, runner.prepare(seqs, is_prefill))
    assert {m.seq.seq_id for m in mismatches} == {0}

    kept, hit = remove_hit(mismatches, seqs, scheduler, tracker)

    assert hit == [x] and kept == [z]
    assert x.status == Status.FINISHED and x.finish_reason == "error"
    assert x.error is not None and f"page {y_last} (logical page 2)" in x.error
    assert y.status == Status.WAITING and list(scheduler.waiting) == [y] and y.num_preemptions == 1
    assert list(scheduler.running) == [z]
    # x gave back the pages it was given (its own last page too, which its table lost track of), not
    # y's page that its table named
    assert manager.pages[x_own_last].ref_count == 0
    assert manager.num_free_pages == NUM_PAGES - len(z.block_table)
    # the prefix pages x was to write are out of the cache: y, readmitted, computes them itself
    assert manager.hash_to_page_id == {}
    seqs, is_prefill = scheduler.schedule()
    assert seqs == [y] and y.num_cached_tokens == 0
    assert tracker.check(seqs, runner.prepare(seqs, is_prefill)) == []
