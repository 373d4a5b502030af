"""Ending exactly the requests a failed step check hit, and keeping the pool safe for everyone else.

A hit request finishes with reason "error" and a message naming what failed; it gives back the pages
the tracker recorded it was given (not what its block table names), so a wrong entry never frees
another request's page. Pages that will never hold what their hash says leave the prefix cache: those
the stopped request sealed this step (their K/V was to be written by the forward it is not in; found
from the tracker's record, not its block table) and pages whose sampled bytes changed. A request that
attached such a page in the same prefill is requeued (recomputed later), not failed. A prefix-cache entry
that led a request to a page not carrying the entry's hash (a stale entry) is dropped, so the next request
with that prefix computes it instead of being stopped in turn.
Imports kvq.runtime (scheduler, sequence) and kvq.runtime.integrity.
"""

from __future__ import annotations

import logging

from kvq.runtime.integrity.mismatch import PageMismatch
from kvq.runtime.integrity.tags import sealed_tag
from kvq.runtime.integrity.tracker import TagTracker
from kvq.runtime.request import Request
from kvq.runtime.scheduler import Scheduler

logger = logging.getLogger("kvq.integrity")


def remove_hit(
    mismatches: list[PageMismatch], seqs: list[Request], scheduler: Scheduler, tracker: TagTracker
) -> tuple[list[Request], list[Request]]:
    """(the step's sequences that still run, the ones ended with an error), before any K/V is read."""
    by_seq: dict[Request, list[PageMismatch]] = {}
    for mismatch in mismatches:
        by_seq.setdefault(mismatch.seq, []).append(mismatch)
    untrusted = {m.page_id for m in mismatches if m.kind == "bytes" and m.page_id is not None}
    unwritten: set[int] = set()
    for seq, hits in by_seq.items():
        unwritten |= tracker.sealed_this_step(seq)
        more = f" (and {len(hits) - 1} more failed checks)" if len(hits) > 1 else ""
        seq.finish_reason, seq.error = "error", f"{hits[0].message()}{more}; the request was stopped"
        logger.error("request %d stopped: %s", seq.seq_id, seq.error)
        scheduler.finish(seq)
    kept = [s for s in seqs if s not in by_seq]
    while orphans := [s for s in kept if tracker.is_given(s, unwritten)]:
        for seq in orphans:
            logger.warning("request %d requeued: it shares pages a stopped request was to write", seq.seq_id)
            unwritten |= tracker.sealed_this_step(seq)
            scheduler.requeue(seq)
        kept = [s for s in kept if s not in orphans]
    manager = scheduler.block_manager
    for page_id in sorted(unwritten | untrusted):
        manager.unhash(page_id)
    for m in mismatches:  # a read of a page attached through a cache entry that names the wrong page
        if m.kind == "read" and m.page_id is not None and 0 <= m.page_id < manager.num_pages:

            def is_stale(page_hash: int, expected: int | None = m.expected) -> bool:
                return sealed_tag(page_hash) == expected

            manager.drop_entry(m.page_id, is_stale)
    return kept, list(by_seq)
