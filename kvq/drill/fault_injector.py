"""Faults the checked KV pool must catch, injected into a live engine on request (the tests, the fault
drill of `kvq bench integrity`).

Nothing here runs unless a `FaultInjector` is made and one of its methods called. Each method makes one
slip the way a real bug would, through the engine's public parts: bookkeeping slips go through the block
manager's own primitives (so the tracker's hooks fire exactly as they would for a bug in the code around
them) or corrupt its public tables; a wrong batch (slot, position, context length) is made by wrapping
the runner's `prepare` for one call; a late write re-runs a checked batch's forward after its request was
aborted; byte faults write the pool's memory directly. Which mode catches which and who is hit:
`kvq.drill.faults`. Imports torch and kvq.runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Tokens
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from kvq.runtime.batch import ForwardBatch
from kvq.runtime.block_manager import ROOT_HASH, chain_hash
from kvq.runtime.integrity.page_sample import PageSample, make_page_sample
from kvq.runtime.kernels.integrity.step_check import guard_slot_mapping
from kvq.runtime.model_runner import ForwardOutput
from kvq.runtime.request import Request

if TYPE_CHECKING:
    from kvq.runtime.engine import Engine

BatchChange = Callable[[ForwardBatch, int, int], ForwardBatch]  # (batch, row, its last token) -> batch


class FaultInjector:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.block_manager = engine.block_manager
        self.on_landed: Callable[[], None] | None = None  # told when a fault injected for later lands

    def running(self, request_id: int) -> Request:
        """The running sequence of `request_id` (its block table is what the faults change)."""
        for seq in self.engine.scheduler.running:
            if seq.seq_id == request_id:
                return seq
        raise LookupError(f"request {request_id} is not running")

    # -- free-list and reference slips -----------------------------------------------------------------
    def premature_free(self, request_id: int, logical_index: int) -> int:
        """Drop a running request's reference to its logical page while it still uses it; were it freed,
        it would go first in the free list and the next allocation would reuse it (vLLM #37076)."""
        page_id = self.running(request_id).block_table[logical_index]
        self._release_to_front(page_id)
        return page_id

    def double_free(self, page_id: int) -> None:
        """Release `page_id` once more than it was taken (a release run twice)."""
        self._release_to_front(page_id)

    # -- prefix-cache slips ----------------------------------------------------------------------------
    def stale_prefix_hit(self, page_id: int, first_page_token_ids: Tokens[int]) -> None:
        """The prefix cache claims that sealed page `page_id` holds the first page `first_page_token_ids`
        of some prompt (an entry left behind for a page whose content changed): the next admitted request
        starting with those tokens attaches a page of a different prefix."""
        manager = self.block_manager
        token_ids = tuple(first_page_token_ids)
        manager.hash_to_page_id[chain_hash(ROOT_HASH, token_ids)] = page_id
        manager.pages[page_id].token_ids = token_ids  # what the lookup re-checks

    def weaken_hash(self) -> None:
        """From now on a page's hash forgets the chain (its own tokens only): pages with equal tokens
        after different prefixes collide."""
        self.block_manager.hash_page = lambda previous, token_ids: chain_hash(ROOT_HASH, token_ids)  # type: ignore[method-assign]

    # -- block-table slips -----------------------------------------------------------------------------
    def off_by_one(self, request_id: int, logical_index: int) -> int:
        """A running request's block-table entry points one physical page further; returns that page."""
        seq = self.running(request_id)
        seq.block_table[logical_index] = (seq.block_table[logical_index] + 1) % self.block_manager.num_pages
        return seq.block_table[logical_index]

    def replace_entry(self, request_id: int, logical_index: int, page_id: int) -> None:
        """A running request's block-table entry names `page_id` (another request's page)."""
        self.running(request_id).block_table[logical_index] = page_id

    def swap_entries(self, id_a: int, index_a: int, id_b: int, index_b: int) -> None:
        """Two running requests' block-table entries swapped."""
        a, b = self.running(id_a).block_table, self.running(id_b).block_table
        a[index_a], b[index_b] = b[index_b], a[index_a]

    def append_entry(self, request_id: int, page_id: int) -> None:
        """A running request's block-table row grows one entry longer than its pages."""
        self.running(request_id).block_table.append(page_id)

    # -- scheduling slips ------------------------------------------------------------------------------
    def preempt(self, request_id: int) -> None:
        """Preempt a running request now (recomputed from its tokens when readmitted)."""
        self.engine.scheduler.requeue(self.running(request_id))

    def after_next_allocate(self, request_id: int, change: Callable[[Request], None]) -> None:
        """`change(seq)` runs right after the request's next admission gave it pages (a slip between the
        block manager and the batch preparation, in the step that seals its new prefix pages)."""
        manager = self.block_manager
        original = manager.allocate

        def allocate(seq: Request) -> None:
            original(seq)
            if seq.seq_id == request_id:
                manager.allocate = original  # type: ignore[method-assign]  # one shot
                change(seq)

        manager.allocate = allocate  # type: ignore[method-assign]

    def skip_cached_token(self, request_id: int) -> None:
        """At the request's next admission its cached-token count claims one token more than the pages it
        attached (a recompute that skips a token: attention would read a slot never written)."""

        def skip(seq: Request) -> None:
            seq.num_cached_tokens += 1

        self.after_next_allocate(request_id, skip)

    def abort_mid_step(self, request_id: int) -> None:
        """The client aborts the request during its next step, after sampling (a token hook calls
        `Engine.abort` while the step is still handling its tokens)."""
        hooks = self.engine.token_hooks

        def hook(seqs: list[Request], logits: torch.Tensor, token_ids: list[int]) -> None:
            if any(s.seq_id == request_id for s in seqs):
                hooks.remove(hook)
                self.engine.abort(request_id)

        hooks.append(hook)

    def late_forward(self, request_id: int, delay: int) -> None:
        """The forward of the next decode step with the request runs once more, `delay` forwards later: a
        batch still in flight when the request was aborted, whose K/V writes land after its pages moved
        on. The request is aborted right after that step, and its freed pages are the next ones taken."""
        runner, engine = self.engine.runner, self.engine
        prepare, forward = runner.prepare, runner.forward
        state: dict = {"rows": [], "late": None, "count": 0}

        def record(seqs: list[Request], is_prefill: bool) -> ForwardBatch:
            state["rows"] = [] if is_prefill else [s.seq_id for s in seqs]
            return prepare(seqs, is_prefill)

        def late(batch: ForwardBatch) -> ForwardOutput:
            if state["late"] is None:
                logits = forward(batch)
                if request_id in state["rows"]:
                    state["late"] = batch
                    pages = list(self.running(request_id).block_table)
                    engine.abort(request_id)
                    for page_id in pages:
                        self._to_front(page_id)
                return logits
            state["count"] += 1
            if state["count"] == delay:
                runner.prepare, runner.forward = prepare, forward  # type: ignore[method-assign]
                forward(state["late"])  # its logits go nowhere; its writes are the fault
            return forward(batch)

        runner.prepare, runner.forward = record, late  # type: ignore[method-assign]

    def late_store(self, request_id: int, then: str = "abort", nth: int = 1) -> None:
        """A write of the request that lands after its page went to another request, past every guard (a
        stream that finishes late, a copy engine behind schedule): the request's `nth` decode step from
        now is recorded with its slot mapping as the write guard left it then; right after that step the
        request is aborted (`then="abort"`) or preempted (`"preempt"`) and its pages go first in the free
        list. After the first later forward when another request fills that page and has written the stale
        slot's offset (but not the whole page), the recorded store runs again for that request's token
        alone (its K/V and slot stamp, into the slot it was checked for) before the next step: the page's
        new owner would read it."""
        runner, engine, size = self.engine.runner, self.engine, self.block_manager.page_size
        prepare, forward = runner.prepare, runner.forward
        state: dict = {"seen": 0, "late": None, "slot": -1, "rows": []}

        def record(seqs: list[Request], is_prefill: bool) -> ForwardBatch:
            state["rows"] = [] if is_prefill else [s.seq_id for s in seqs]
            return prepare(seqs, is_prefill)

        def late(batch: ForwardBatch) -> ForwardOutput:
            out = forward(batch)
            if state["late"] is None:
                if request_id in state["rows"]:
                    state["seen"] += 1
                    if state["seen"] == nth:
                        self._record_late(batch, state, request_id, then)
                return out
            slot = state["slot"]
            # the page's owner now (the request itself, recomputed after a preemption, is a new owner)
            owner = next((s for s in engine.scheduler.running if slot // size in s.block_table), None)
            if owner is not None:
                written = owner.num_tokens - 1 - owner.block_table.index(slot // size) * size  # last offset
                if slot % size <= written < size - 1:  # it wrote the stale slot, and fills the page still
                    runner.prepare, runner.forward = prepare, forward  # type: ignore[method-assign]
                    runner.forward_local(state["late"])  # its logits go nowhere; its store is the fault
                    if self.on_landed is not None:
                        self.on_landed()
            return out

        runner.prepare, runner.forward = record, late  # type: ignore[method-assign]

    def _record_late(self, batch: ForwardBatch, state: dict, request_id: int, then: str) -> None:
        """Keep `batch` with the request's own write only, as guarded now (in `off`, as prepared: there is no
        guard); abort or preempt the request."""
        guard = batch.write_guard
        size = self.block_manager.page_size
        slots = batch.slot_mapping
        if guard is not None:
            slots = guard_slot_mapping(guard.page_tags, batch.slot_mapping, guard.write_tags, size)
        seq = self.running(request_id)
        token = state["rows"].index(request_id)  # a decode batch: one token per row
        only = torch.full_like(slots, -1)
        only[token] = slots[token]
        state["slot"] = int(slots[token])
        state["late"] = replace(batch, slot_mapping=only, write_guard=None)
        pages = list(seq.block_table)
        if then == "abort":
            self.engine.abort(request_id)
        else:
            self.engine.scheduler.requeue(seq)
        for page_id in reversed(pages):
            self._to_front(page_id)

    # -- wrong batches (one prepare call) ----------------------------------------------------------------
    def change_next_batch(self, request_id: int, change: BatchChange) -> None:
        """The next decode batch with the request is changed by `change(batch, row, token)` (a bug in the
        batch preparation, or anything that touches the batch between preparation and the kernels)."""
        runner = self.engine.runner
        original = runner.prepare

        def prepare(seqs: list[Request], is_prefill: bool) -> ForwardBatch:
            batch = original(seqs, is_prefill)
            rows = [i for i, s in enumerate(seqs) if s.seq_id == request_id]
            if is_prefill or not rows:
                return batch
            runner.prepare = original  # type: ignore[method-assign]  # one shot
            return change(batch, rows[0], sum(batch.query_lens[: rows[0] + 1]) - 1)

        runner.prepare = prepare  # type: ignore[method-assign]

    def change_next_prefill(self, request_id: int, change: BatchChange) -> None:
        """As `change_next_batch`, for the prefill that admits the request (`token`: its first new one)."""
        runner = self.engine.runner
        original = runner.prepare

        def prepare(seqs: list[Request], is_prefill: bool) -> ForwardBatch:
            batch = original(seqs, is_prefill)
            rows = [i for i, s in enumerate(seqs) if s.seq_id == request_id]
            if not is_prefill or not rows:
                return batch
            runner.prepare = original  # type: ignore[method-assign]
            return change(batch, rows[0], sum(batch.query_lens[: rows[0]]))

        runner.prepare = prepare  # type: ignore[method-assign]

    def misdirected_write(self, writer_id: int, victim_id: int, victim_index: int = 0) -> None:
        """In the next decode step with the writer, its new token's K/V goes to a slot of the victim's
        logical page `victim_index` (a wrong slot mapping: a slot-reuse race, SGLang PR #24226)."""
        page_size = self.block_manager.page_size

        def change(batch: ForwardBatch, row: int, token: int) -> ForwardBatch:
            victim = self.running(victim_id).block_table[victim_index]
            batch.slot_mapping[token] = victim * page_size + page_size - 1
            return batch

        self.change_next_batch(writer_id, change)

    def context_one_too_long(self, request_id: int, delta: int = 1) -> None:
        """In the next decode step with the request, attention reads `delta` slots past its last token (the
        context length one too long, in every form the kernels take it: tensor, list, bound, plan; a
        negative `delta`: too short)."""
        runner = self.engine.runner

        def change(batch: ForwardBatch, row: int, token: int) -> ForwardBatch:
            lens = list(batch.context_lens_list)
            lens[row] = max(lens[row] + delta, 1)
            lens_t = torch.tensor(lens, dtype=batch.context_lens.dtype).to(batch.context_lens.device)
            plan = runner.plan_decode(batch.block_tables, lens_t, lens)
            return replace(
                batch,
                context_lens=lens_t,
                context_lens_list=lens,
                max_context_len=max(lens),
                decode_plan_of=lambda: plan,
            )

        self.change_next_batch(request_id, change)

    # -- byte faults (caught in full mode) ------------------------------------------------------------
    def stray_write(self, page_id: int, slot: int, source_page: int, source_slot: int) -> None:
        """Copy one token slot's cache rows, in every layer, from another page over `page_id`'s `slot`: a
        write that reached the pool without going through the slot mapping."""
        storage = self.engine.kv_pool.storage  # [L, C, P + 1, page_size, ...]
        storage[:, :, page_id, slot] = storage[:, :, source_page, source_slot]

    def bit_flip(
        self, page_id: int, layer: int = 0, part: int = 0, byte_offset: int | None = None, bit: int = 6
    ) -> int:
        """Flip one bit of a page's bytes of `part` (GQA: 0 K, 1 V; MLA: 0 the latent) in `layer`; returns
        the byte offset. `byte_offset` None: the first byte `full` mode samples (a flip elsewhere is
        caught only with probability samples / row bytes, see `page_sample`); in another mode, the byte
        `full` would sample."""
        pool_bytes = self.engine.kv_pool.page_bytes_view()  # [L, C, P + 1, page_size * row_bytes]
        if byte_offset is None:
            byte_offset = int(self._page_sample(pool_bytes).offsets[0])
        pool_bytes[layer, part, page_id, byte_offset] ^= torch.tensor(1 << bit, dtype=torch.uint8)
        return byte_offset

    # -- internals ------------------------------------------------------------------------------------
    def _page_sample(self, pool_bytes: torch.Tensor) -> PageSample:
        """The `full` tracker's byte sample (made alike when the engine runs in another mode)."""
        tracker, pool = self.engine.tracker, self.engine.kv_pool
        if tracker is not None and tracker.sample is not None:
            return tracker.sample
        num_layers, num_parts = pool_bytes.shape[:2]
        return make_page_sample(num_layers, pool.page_size, pool.row_bytes, pool.device, num_parts=num_parts)

    def _release_to_front(self, page_id: int) -> None:
        self.block_manager.release_page(page_id)
        self._to_front(page_id)

    def _to_front(self, page_id: int) -> None:
        """A free page goes first in the free list (the next allocation takes it)."""
        manager = self.block_manager
        if manager.pages[page_id].ref_count == 0 and page_id in manager.free_page_ids:
            manager.free_page_ids.remove(page_id)
            manager.free_page_ids.appendleft(page_id)
