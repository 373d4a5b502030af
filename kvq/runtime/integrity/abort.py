"""Ending exactly the requests a failed page check hit, and keeping the pool safe for everyone else.

A hit request finishes with reason "error" and a message naming the page; its references are released,
except to pages that are not its own any more (those belong to whoever holds them now). Pages that will
never hold what their hash says leave the prefix cache: pages whose sampled bytes changed, and pages
sealed this step for a request that leaves the batch before the forward that would write them. A request
that attached such a page in the same prefill is requeued (recomputed later), not failed.
Imports kvq.runtime (scheduler, block manager, sequence) and kvq.runtime.integrity.mismatch.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from kvq.runtime.block_manager import BlockManager
from kvq.runtime.integrity.mismatch import PageMismatch
from kvq.runtime.scheduler import Scheduler
from kvq.runtime.sequence import Sequence

logger = logging.getLogger("kvq.integrity")


def remove_hit(
    mismatches: list[PageMismatch], seqs: list[Sequence], is_prefill: bool, scheduler: Scheduler
) -> tuple[list[Sequence], list[Sequence]]:
    """(the step's sequences that still run, the ones ended with an error), before any K/V is read."""
    block_manager = scheduler.block_manager
    by_seq: dict[Sequence, list[PageMismatch]] = {}
    for mismatch in mismatches:
        by_seq.setdefault(mismatch.seq, []).append(mismatch)
    untrusted = {m.page_id for m in mismatches if m.kind == "bytes"}
    unwritten: set[int] = set()
    for seq, hits in by_seq.items():
        lost = {m.logical_index for m in hits if m.kind == "read"}
        unwritten |= _unwritten_pages(seq, is_prefill, block_manager, lost)
        more = f" (and {len(hits) - 1} more failed page checks)" if len(hits) > 1 else ""
        seq.finish_reason, seq.error = "error", f"{hits[0].message()}{more}; the request was stopped"
        logger.error("request %d stopped: %s", seq.seq_id, seq.error)
        scheduler.finish(seq, lost)
    kept = [s for s in seqs if s not in by_seq]
    while orphans := [s for s in kept if not unwritten.isdisjoint(s.block_table)]:
        for seq in orphans:
            logger.warning("request %d requeued: it shares pages a stopped request was to write", seq.seq_id)
            unwritten |= _unwritten_pages(seq, is_prefill, block_manager, ())
            scheduler.requeue(seq)
        kept = [s for s in kept if s not in orphans]
    for page_id in sorted(unwritten | untrusted):
        block_manager.unhash(page_id)
    return kept, list(by_seq)


def _unwritten_pages(
    seq: Sequence, is_prefill: bool, block_manager: BlockManager, lost: Collection[int]
) -> set[int]:
    """Sealed pages of `seq` whose K/V this step's forward was to write (all of it, or its last token)."""
    first = (seq.num_cached_tokens if is_prefill else seq.num_tokens - 1) // block_manager.page_size
    return {
        page_id
        for i, page_id in enumerate(seq.block_table)
        if i >= first and i not in lost and block_manager.pages[page_id].hash is not None
    }
