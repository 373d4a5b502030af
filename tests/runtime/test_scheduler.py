"""Scheduler: admission by free pages (with the decode reserve), batching limits, preemption by recompute."""

from __future__ import annotations

from kvq.runtime.block_manager import BlockManager
from kvq.runtime.request import Request, Status
from kvq.runtime.sampling import SamplingParams
from kvq.runtime.scheduler import Scheduler

P = 4


def make(num_pages: int, ratio: float, max_num_seqs: int = 8, max_batched: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_pages, P), max_num_seqs, max_batched, ratio)


def request(seq_id: int, prompt_len: int = 4, max_tokens: int = 8) -> Request:
    tokens = [seq_id * 100 + i for i in range(prompt_len)]  # distinct: no prefix sharing
    return Request(seq_id, tokens, prompt_len, SamplingParams(max_tokens=max_tokens), prompt_len + max_tokens)


def decode_step(s: Scheduler) -> list[Request]:
    """One scheduled decode step, each sequence gaining one token (as the engine does after sampling)."""
    seqs, is_prefill = s.schedule()
    assert not is_prefill
    return seqs


def test_admission_reserves_pages_for_max_tokens() -> None:
    s = make(num_pages=7, ratio=1.0)  # each request needs 3 pages (4 prompt + 8 new tokens)
    for i in range(4):
        s.add(request(i))
    seqs, is_prefill = s.schedule()
    assert is_prefill and [q.seq_id for q in seqs] == [0, 1]  # a third would not fit its 3 pages
    assert len(s.waiting) == 2


def test_prompt_only_admission_then_preemption_by_recompute() -> None:
    s = make(num_pages=4, ratio=0.0)
    seqs = [request(i) for i in range(4)]  # one page of prompt each: all four admitted
    for q in seqs:
        s.add(q)
    admitted, _ = s.schedule()
    assert len(admitted) == 4 and s.block_manager.num_free_pages == 0
    for q in admitted:
        q.token_ids.append(1)  # the sampled token starts page 2: no page is free
    running = decode_step(s)
    # the newest running requests give their pages up, and wait first in line, oldest first
    assert running == seqs[:2] and s.num_preemptions == 2
    assert list(s.waiting) == seqs[2:] and all(q.status == Status.WAITING for q in seqs[2:])
    assert all(q.block_table == [] for q in seqs[2:])
    assert all(len(q.block_table) == 2 for q in running)
    # a preempted request keeps its generated token and is recomputed from prompt + completion
    assert all(q.num_tokens == 5 for q in seqs[2:])


def test_max_num_seqs_and_batched_tokens_bound_a_prefill() -> None:
    s = make(num_pages=64, ratio=0.0, max_num_seqs=3, max_batched=10)
    for i in range(5):
        s.add(request(i, prompt_len=4))
    seqs, _ = s.schedule()
    assert len(seqs) == 2  # 4 + 4 tokens; a third prompt would make 12 > 10
    seqs, _ = s.schedule()
    assert len(seqs) == 1  # max_num_seqs = 3 running
    seqs, is_prefill = s.schedule()
    assert not is_prefill and len(seqs) == 3


def test_a_prompt_longer_than_the_token_budget_still_runs_alone() -> None:
    s = make(num_pages=64, ratio=0.0, max_batched=8)
    s.add(request(0, prompt_len=20))
    seqs, is_prefill = s.schedule()
    assert is_prefill and len(seqs) == 1


def test_finish_frees_pages_and_admits_waiting_requests() -> None:
    s = make(num_pages=3, ratio=1.0)
    first, second = request(0), request(1)
    s.add(first)
    s.add(second)
    assert s.schedule()[0] == [first]
    s.finish(first)
    assert first.status == Status.FINISHED and s.block_manager.num_free_pages == 3
    assert s.schedule()[0] == [second]


def test_requeue_preempts_a_running_request() -> None:
    s = make(num_pages=8, ratio=0.0)
    first, second = request(0, prompt_len=6), request(1, prompt_len=6)
    s.add(first)
    s.add(second)
    assert s.schedule()[0] == [first, second]
    s.requeue(second)  # out of this step, recomputed when readmitted
    assert list(s.running) == [first] and list(s.waiting) == [second]
    assert second.status == Status.WAITING and second.num_preemptions == s.num_preemptions == 1
    s.finish(first)
    assert first.status == Status.FINISHED and not s.running
    assert s.block_manager.num_free_pages == 8
