"""The checked KV pool at `--tp N`: every rank checks its own pool's pages.

Rank 0 keeps the ledger (holdings, tags, the prefix cache's pages) and runs the step check as at --tp 1.
The ranks past 0 hold pages of their own under the same page ids (their share of the GQA KV heads, or a
replicated MLA latent); each keeps a tracker over its own pool (`make_tracker`) whose tag table mirrors
rank 0's (the changes since the last message travel with each one) and, in `full` mode, its own hashes of
its own pages' sampled bytes. Per checked step, after rank 0's own check passed:
- `RankCheck`, before the forward: each rank checks the batch it made from the broadcast inputs against
  rank 0's expectations over its tag mirror (`TagTracker.check_pages`: block-table entries, lengths,
  positions and slots), in full mode also re-hashing the sealed pages the step reads; the failures are
  gathered to rank 0, which ends exactly the requests they hit (`remove_hit`, the message naming the
  rank) and checks again, as for its own;
- `RankStep`, the forward: each rank applies the write guard over its mirror with rank 0's write tags
  (a late batch's writes land on no rank), stamps its slots with rank 0's slot stamps (every rank's pool
  carries the same stamps, and `RankCheck` verifies each rank's own), and in full mode hashes the pages
  the forward sealed, right after it.
Draft stamps (`--speculative`): each rank stamps a verification's slots with rank 0's (drafts marked), and
the stamps rank 0 rewrites for accepted drafts travel with its next message, so every rank's stamps stay
rank 0's across rollbacks (a rejected draft's slot read later fails on every rank).
`RankReset` follows `Engine.reset_kv` (each rank's `ModelRunner.loop` makes a new tracker). A step with
integrity `off` sends the bare `StepInputs` (no check).
Cost at --tp N: one more broadcast and one gather per checked step. Imports numpy, torch and kvq.runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from kvq.runtime.batch import ForwardBatch, StepInputs
from kvq.runtime.distributed.group import TpGroup
from kvq.runtime.integrity.mismatch import CheckedStep, HostFindings, PageMismatch, StepMismatches
from kvq.runtime.integrity.tags import FREE_TAG
from kvq.runtime.integrity.tracker import TagTracker
from kvq.runtime.request import Request


@dataclass(frozen=True)
class TagChanges:
    """Page tags rank 0 changed since its previous message (every other rank's mirror applies them), and the
    slot stamps it rewrote (`TagTracker.confirm_drafts`: accepted drafts lose their draft mark)."""

    pages: list[int]
    tags: list[int]
    restamps: list[tuple[int, int, int]]


@dataclass(frozen=True)
class RankCheck:
    """Check this step's batch on your own pool, and send rank 0 what failed."""

    inputs: StepInputs
    step: CheckedStep
    tags: TagChanges


@dataclass(frozen=True)
class RankStep:
    """Run this checked batch: writes guarded by `write_tags` and stamped `slot_stamps`, then hash the
    pages it `sealed` (full)."""

    inputs: StepInputs
    write_tags: list[int]
    sealed: list[int]
    tags: TagChanges
    slot_stamps: list[int] | None = None


@dataclass(frozen=True)
class RankReset:
    """Fresh bookkeeping in `kv_integrity` mode (`Engine.reset_kv`)."""

    kv_integrity: str


class RankLeader:
    """Rank 0's side: the messages, and the other ranks' failures as rank 0's mismatches."""

    def __init__(self, tp: TpGroup, tracker: TagTracker) -> None:
        self.tp, self.tracker = tp, tracker
        self._sent = np.zeros(tracker.num_pages, dtype=np.int64)  # the tags the other ranks' mirrors hold
        tracker.restamps = []

    def check(self, seqs: list[Request], batch: ForwardBatch) -> list[PageMismatch]:
        """Every other rank's failures of `batch` (which passed rank 0's `check`), naming the rank."""
        tracker, step = self.tracker, self.tracker.last_check
        assert step is not None and batch.inputs is not None
        self.tp.broadcast(RankCheck(batch.inputs, step, self._changes()))
        found: list[PageMismatch] = []
        for rank, failed in enumerate(self.tp.gather(HostFindings())):
            if rank and failed:
                assert isinstance(failed, HostFindings)
                mismatches = StepMismatches(seqs, batch, tracker.num_pages, tracker.page_size)
                failed.report(mismatches, step, tracker.tag_of)
                found += [replace(m, rank=rank) for m in mismatches.found]
        return found

    def step_message(self, batch: ForwardBatch) -> object:
        """What the other ranks get for `batch`'s forward (`ModelRunner.forward`)."""
        guard, tracker = batch.write_guard, self.tracker
        if guard is None or batch.inputs is None:
            return batch.inputs
        sealed = [p for p in tracker.sealed_now if tracker.tag_of(p) != FREE_TAG] if tracker.is_full else []
        stamps = None if batch.slot_stamps is None else batch.slot_stamps.tolist()
        return RankStep(batch.inputs, guard.write_tags.tolist(), sealed, self._changes(), stamps)

    def _changes(self) -> TagChanges:
        host = self.tracker.host_tags.numpy()
        pages = np.flatnonzero(host != self._sent)
        self._sent[pages] = host[pages]
        restamps, self.tracker.restamps = self.tracker.restamps or [], []
        return TagChanges(pages.tolist(), host[pages].tolist(), restamps)
