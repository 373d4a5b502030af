"""Continuous batching: each step is a prefill of newly admitted requests or one decode token for every
running one. Admission is by free pages (the pool is allocated up front, so excess requests wait rather
than run the process out of memory); when decode runs out of pages the newest running request is
preempted and later recomputed from its tokens. Imports kvq.runtime only (the engine's config for a type).
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

from kvq.runtime.block_manager import BlockManager
from kvq.runtime.request import Request, Status

if TYPE_CHECKING:
    from kvq.runtime.config import EngineConfig


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        decode_reserve_ratio: float,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.block_manager = block_manager
        self.num_speculative_tokens = num_speculative_tokens  # drafts a decode step makes room for
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.decode_reserve_ratio = decode_reserve_ratio
        self.waiting: deque[Request] = deque()
        self.running: deque[Request] = deque()
        self.num_preemptions = 0

    @classmethod
    def of(cls, block_manager: BlockManager, config: EngineConfig) -> Scheduler:
        """The scheduler an engine's `config` asks for, over its `block_manager`."""
        num_speculative_tokens = config.num_speculative_tokens if config.speculative is not None else 0
        return cls(
            block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.decode_reserve_ratio,
            num_speculative_tokens,
        )

    def add(self, seq: Request) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Request], bool]:
        """The sequences of the next step and whether it is a prefill step (prefill goes first)."""
        scheduled: list[Request] = []
        num_batched_tokens = 0
        reserved = sum(self._decode_reserve(s) for s in self.running)
        while self.waiting and len(self.running) + len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            is_over_budget = num_batched_tokens + seq.num_tokens > self.max_num_batched_tokens
            reserve = reserved + self._decode_reserve(seq)
            if (scheduled and is_over_budget) or not self.block_manager.can_allocate(seq, reserve):
                break
            self.block_manager.allocate(seq)
            reserved += self._decode_reserve(seq)
            num_batched_tokens += seq.num_tokens - seq.num_cached_tokens
            seq.status = Status.RUNNING
            scheduled.append(self.waiting.popleft())
        if scheduled:
            self.running.extend(scheduled)
            return scheduled, True
        while self.running:
            seq = self.running.popleft()
            num_drafts = seq.num_drafts(self.num_speculative_tokens)
            while not self.block_manager.can_append(seq, num_drafts):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq, num_drafts)
                scheduled.append(seq)
        self.running.extend(scheduled)
        return scheduled, False

    def admit_prefilled(self, seq: Request, num_computed: int) -> bool:
        """Give pages to a sequence whose first `num_computed` tokens' K/V another engine computed and run
        it from this step's decode, which computes its last token (no prefill here); False when the pool
        or the batch has no room for it yet."""
        if len(self.running) >= self.max_num_seqs:
            return False
        token_ids, seq.token_ids = seq.token_ids, seq.token_ids[:num_computed]  # pages for these only
        try:
            reserve = sum(self._decode_reserve(s) for s in self.running) + self._decode_reserve(seq)
            if not self.block_manager.can_allocate(seq, reserve):
                return False
            self.block_manager.allocate(seq)
        finally:
            seq.token_ids = token_ids
        seq.status = Status.RUNNING
        self.running.append(seq)
        return True

    def preempt(self, seq: Request) -> None:
        """Free `seq`'s pages and put it first in line; it is recomputed from its tokens when readmitted."""
        self.block_manager.deallocate(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Request) -> None:
        """Release a finished sequence's pages and take it out of the running set."""
        self.block_manager.deallocate(seq)
        seq.status = Status.FINISHED
        self.running.remove(seq)

    def abort(self, seq_id: int) -> Request | None:
        """Take request `seq_id` out, queued or running (its pages are freed); None if it is not here."""
        for seq in self.waiting:
            if seq.seq_id == seq_id:  # a waiting request holds no pages (preemption freed them)
                self.waiting.remove(seq)
                seq.status = Status.FINISHED
                return seq
        for seq in self.running:
            if seq.seq_id == seq_id:
                self.finish(seq)
                return seq
        return None

    def requeue(self, seq: Request) -> None:
        """Take a running sequence out of this step and preempt it (recomputed when readmitted)."""
        self.running.remove(seq)
        self.preempt(seq)

    def _decode_reserve(self, seq: Request) -> int:
        """Pages held back for the tokens `seq` may still generate (decode_reserve_ratio of them)."""
        held = len(seq.block_table) or self.block_manager.pages_for(seq.num_tokens)  # waiting: its prompt
        future = self.block_manager.pages_for(seq.max_len) - held
        return math.ceil(self.decode_reserve_ratio * max(future, 0))
