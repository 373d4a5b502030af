"""Faults the checked KV pool must catch, injected into a live engine on request (the tests, the fault
drill of `kvq bench integrity`).

Nothing here runs unless a `FaultInjector` is made and one of its methods called. Each method makes one
slip the way a real bug would, through the engine's public parts: bookkeeping slips go through the block
manager's own primitives (so the tag hooks fire exactly as they would for a bug in the code around them)
or corrupt its public tables; a wrong slot mapping is made by wrapping the runner's `prepare` for one
call; byte faults write the pool's memory directly. Which mode catches which, and who is hit:
- premature free + reuse, double free: `tags`; the request the page was taken from (not its new owner);
- stale prefix-cache hit, off-by-one block-table entry: `tags`; the request with the wrong entry;
- K/V written into another request's slot: `tags` when the slot mapping is wrong (the writer is hit
  before the write happens, the other request is untouched); `full` when the bytes land without the
  slot mapping (`stray_write`: every holder of the overwritten sealed page is hit);
- bit flip: `full`, in a byte the sampled hash covers (every holder of the sealed page is hit).
Imports torch and kvq.runtime.
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens
from typing import TYPE_CHECKING

import torch

from kvq.runtime.batch import ForwardBatch
from kvq.runtime.block_manager import ROOT_HASH, chain_hash
from kvq.runtime.sequence import Sequence

if TYPE_CHECKING:
    from kvq.runtime.engine import Engine


class FaultInjector:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.block_manager = engine.block_manager

    def running(self, request_id: int) -> Sequence:
        """The running sequence of `request_id` (its block table is what the faults change)."""
        for seq in self.engine.scheduler.running:
            if seq.seq_id == request_id:
                return seq
        raise LookupError(f"request {request_id} is not running")

    # -- bookkeeping slips (caught in tags mode) --------------------------------------------------------
    def premature_free(self, request_id: int, logical_index: int) -> int:
        """Drop a running request's reference to its logical page while it still uses it; freed, the page
        goes first in the free list, so the next allocation reuses it (vLLM #37076, SGLang #38319)."""
        page_id = self.running(request_id).block_table[logical_index]
        self._release_to_front(page_id)
        return page_id

    def double_free(self, page_id: int) -> None:
        """Release `page_id` once more than it was taken (a release run twice). When the reference dropped
        was the last one of a request still running, the page is freed under it, goes first in the free
        list, and its next taker becomes a second owner."""
        self._release_to_front(page_id)

    def stale_prefix_hit(self, page_id: int, first_page_token_ids: Tokens[int]) -> None:
        """The prefix cache claims that sealed page `page_id` holds the first page `first_page_token_ids`
        of some prompt (an entry left behind for a page whose content changed): the next admitted request
        starting with those tokens attaches a page of a different prefix."""
        manager = self.block_manager
        token_ids = tuple(first_page_token_ids)
        manager.hash_to_page_id[chain_hash(ROOT_HASH, token_ids)] = page_id
        manager.pages[page_id].token_ids = token_ids  # what the lookup re-checks

    def off_by_one(self, request_id: int, logical_index: int) -> int:
        """A running request's block-table entry points one physical page further; returns that page."""
        seq = self.running(request_id)
        seq.block_table[logical_index] = (seq.block_table[logical_index] + 1) % self.block_manager.num_pages
        return seq.block_table[logical_index]

    def misdirected_write(self, writer_id: int, victim_id: int, victim_index: int = 0) -> None:
        """In the next step that includes the writer, its last new token's K/V goes to a slot of the
        victim's logical page `victim_index` (a wrong slot mapping: a slot-reuse race, SGLang PR #24226)."""
        runner = self.engine.runner
        page_size = self.block_manager.page_size
        original = runner.prepare

        def prepare(seqs: list[Sequence], is_prefill: bool) -> ForwardBatch:
            batch = original(seqs, is_prefill)
            rows = [i for i, s in enumerate(seqs) if s.seq_id == writer_id]
            if rows:
                runner.prepare = original  # type: ignore[method-assign]  # one shot
                token = sum(batch.query_lens[: rows[0] + 1]) - 1
                victim = self.running(victim_id).block_table[victim_index]
                batch.slot_mapping[token] = victim * page_size + page_size - 1
            return batch

        runner.prepare = prepare  # type: ignore[method-assign]

    # -- byte faults (caught in full mode) ------------------------------------------------------------
    def stray_write(self, page_id: int, slot: int, source_page: int, source_slot: int) -> None:
        """Copy one token slot's K and V, in every layer, from another page over `page_id`'s `slot`: a
        write that reached the pool without going through the slot mapping."""
        storage = self.engine.kv_pool.storage  # [L, 2, P + 1, page_size, Hkv, D]
        storage[:, :, page_id, slot] = storage[:, :, source_page, source_slot]

    def bit_flip(
        self, page_id: int, layer: int = 0, half: int = 0, byte_offset: int | None = None, bit: int = 6
    ) -> int:
        """Flip one bit of a page's K (half 0) or V (half 1) bytes in `layer`; returns the byte offset.
        `byte_offset` None: the first byte `full` mode samples (a flip elsewhere is caught only with
        probability samples / row bytes, see `page_sample`)."""
        if byte_offset is None:
            tracker = self.engine.tracker
            if tracker is None or tracker.sample is None:
                raise ValueError("byte_offset=None picks a sampled byte: it needs an engine in full mode")
            byte_offset = int(tracker.sample.offsets[0])
        pool_bytes = self.engine.kv_pool.page_bytes_view()  # [L, 2, P + 1, page_size * row_bytes]
        pool_bytes[layer, half, page_id, byte_offset] ^= torch.tensor(1 << bit, dtype=torch.uint8)
        return byte_offset

    # -- internals ------------------------------------------------------------------------------------
    def _release_to_front(self, page_id: int) -> None:
        manager = self.block_manager
        manager.release_page(page_id)
        if manager.pages[page_id].ref_count == 0:
            manager.free_page_ids.remove(page_id)
            manager.free_page_ids.appendleft(page_id)
