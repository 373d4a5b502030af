"""The checked KV pool's once-per-step proof (`--kv-integrity tags` or `full`), over the ledger's state.

`screen(seqs)` (host, before the batch is prepared) stops requests a hook marked and requests whose pages and
tokens disagree; `check(seqs, batch)` then proves the prepared batch in one gather-and-compare on the device
(`kernels.integrity.step_check`), before the model reads any page: every block-table entry carries its
request's tag (and a row names no page past what it holds), every context length is the tokens its request
holds, and every new token has its request's position and the slot that position owns. The expectations come
from each request's own tokens and the ledger, never from the batch. By induction over steps, attention then
reads only slots its own request wrote, at their positions: a sealed page was written by the checked forward
of the request that sealed it, a page being filled by its own earlier checked steps. `guard(batch)` adds the
write guard (`ForwardBatch.write_guard`): a write whose page moved on after the check is skipped. A
`--speculative` verification is checked as a batch of each request's last token and drafts; its drafts' stamps
carry `DRAFT_MARK` until accepted. In `full` mode the sampled bytes of each sealed page in the step are
re-hashed against the hash taken after the forward that wrote it (`after_step`).
Imports torch and kvq.runtime.
"""

from __future__ import annotations

import torch

from kvq.runtime.batch import ForwardBatch, WriteGuard
from kvq.runtime.integrity.ledger import Holding, PageLedger
from kvq.runtime.integrity.mismatch import CheckedStep, PageFindings, PageMismatch, StepMismatches
from kvq.runtime.integrity.page_sample import PageSample
from kvq.runtime.integrity.tags import FREE_TAG
from kvq.runtime.kernels.integrity.batch_check import NO_BYTE_HASH, BatchCheck, BatchTensors, PageHashes
from kvq.runtime.kernels.integrity.page_check import sampled_page_hash
from kvq.runtime.kernels.integrity.stamp_check import check_stamps
from kvq.runtime.kernels.integrity.step_check import StepCheckInputs, check_step
from kvq.runtime.request import Request

# XORed into a draft's slot stamp by its verification: the stamp of no real position (positions stay below
# 2^31), so a rolled-back draft's slot read before it is rewritten fails the stamp check
DRAFT_MARK = 1 << 31


class TagTracker(PageLedger):
    """The ledger (block manager hooks), the device tag table and the step check for one KV pool."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        device: torch.device,
        pool_bytes: torch.Tensor | None = None,
        sample: PageSample | None = None,
        stamps: torch.Tensor | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__(num_pages, page_size)
        self.device = device
        self.backend = backend  # the pool's kernel backend, chosen at load (None: by the device, per check)
        self.stamps = stamps  # [P + 1, page_size, L] int64: the pool's slot stamps (None: not checked)
        self._slot_stamps: torch.Tensor | None = None  # [T]: what the last checked batch's writes stamp
        is_cpu = device.type == "cpu"
        self.page_tags = (
            self.host_tags if is_cpu else torch.zeros(num_pages, dtype=torch.int64, device=device)
        )
        self.pool_bytes, self.sample = pool_bytes, sample  # pool_bytes [L, C, P + 1, R] uint8
        self.is_full = sample is not None
        self.byte_hashes = torch.full((num_pages,), NO_BYTE_HASH, dtype=torch.int64, device=device)
        self._write_tags: torch.Tensor | None = None  # [T]: of the last batch that passed its check
        hashes = None
        if pool_bytes is not None and sample is not None:
            hashes = PageHashes(pool_bytes, sample.offsets, sample.coeffs, self.byte_hashes)
        # the whole check as one C call on a CPU pool (a failure is then named by the separate checks)
        self._batch_check = BatchCheck(self.page_tags, page_size, stamps, hashes, backend)
        self.last_check: CheckedStep | None = None  # what the last `check` that got to the pages used
        # (page, offset, stamp) of `confirm_drafts` not yet sent to the other ranks (None: at --tp 1)
        self.restamps: list[tuple[int, int, int]] | None = None

    # -- the step check ---------------------------------------------------------------------------------
    def screen(self, seqs: list[Request], num_drafts: list[int] | None = None) -> list[PageMismatch]:
        """Host only, before the batch is made: requests a hook marked, and requests whose holding,
        block table and token count (plus `num_drafts[b]`, a verification's) disagree (the batch of such
        a request could not be laid out)."""
        out = []
        size = self.page_size
        drafts = num_drafts or [0] * len(seqs)
        for seq, num_drafted in zip(seqs, drafts, strict=True):
            fault = self.faults.get(seq.seq_id)
            holding = self.holdings.get(seq.seq_id)
            num_given = 0 if holding is None else len(holding.tags)
            num_needed = -(-(seq.num_tokens + num_drafted) // size)
            if fault is None and not num_given == num_needed == len(seq.block_table):
                extra = seq.block_table[num_given:]
                past = f" (past them: page {', page '.join(map(str, extra))})" if extra else ""
                fault = (
                    f"KV integrity: the request holds {seq.num_tokens} tokens ({num_needed} pages) but was "
                    f"given {num_given} pages and its block table names {len(seq.block_table)}{past}"
                )
            if fault is not None:
                out.append(PageMismatch(seq, "bookkeeping", detail=fault))
        return out

    def check(
        self, seqs: list[Request], batch: ForwardBatch, num_drafts: list[int] | None = None
    ) -> list[PageMismatch]:
        """Every failure of this step's batch (empty: all good). One gather-and-compare, one host sync.
        What it checked against stays in `last_check` (tensor-parallel ranks past 0 check their own pool
        against the same, `integrity.ranks`). With `num_drafts` the batch is a verification: each request's
        last token and its drafts (`num_drafts[b] + 1` rows), whose stamps carry `DRAFT_MARK` until
        `confirm_drafts` says which were accepted."""
        mismatches = StepMismatches(seqs, batch, self.num_pages, self.page_size)
        self.last_check = None
        if num_drafts is None:
            query_lens, lens = self._query_lens(seqs, batch.is_prefill), [s.num_tokens for s in seqs]
        else:
            query_lens = [d + 1 for d in num_drafts]
            lens = [s.num_tokens + d for s, d in zip(seqs, num_drafts, strict=True)]
        if mismatches.check_lists(query_lens, lens):
            return mismatches.found  # the batch's host lists disagree: its tokens cannot be lined up
        is_prefill = batch.is_prefill and num_drafts is None  # a verification attaches nothing
        expected = self._expected(seqs, batch.query_lens, batch.block_tables.shape[1], is_prefill, lens)
        size = self.page_size
        sealed = (
            list(dict.fromkeys(p for s in seqs for p in s.block_table[: s.num_tokens // size]))
            if self.is_full
            else []
        )
        passed = self._passed(batch, expected, sealed)
        findings = self._findings(batch, expected, sealed) if passed is None else None
        self.last_check = step = CheckedStep(expected, sealed)
        failed = None if findings is None else findings.on_host()
        if not failed:
            if passed is None:
                assert findings is not None
                passed = findings.write_tags, findings.slot_stamps
            self._write_tags, self._slot_stamps = passed
            if num_drafts is not None and self._slot_stamps is not None:
                is_draft = [row > 0 for d in num_drafts for row in range(d + 1)]
                marks = torch.tensor(is_draft, dtype=torch.int64).to(self.device) * DRAFT_MARK
                self._slot_stamps = self._slot_stamps ^ marks
            return []
        failed.report(mismatches, step, self.tag_of)
        self._stop_writers(seqs, mismatches)
        return mismatches.found

    def _stop_writers(self, seqs: list[Request], mismatches: StepMismatches) -> None:
        """The request that wrote a slot another reads (a stamp's writer half names the page it took),
        when it still holds pages: stopped too, now if it is in this step, else at its next check."""
        wrong = {(m.found >> 32) & 0xFFFFFFFF: m for m in mismatches.found if m.kind == "stamp" and m.found}
        if not wrong:
            return
        in_step = {s.seq_id: s for s in seqs}
        for seq_id, holding in self.holdings.items():
            taken = holding.writers[holding.num_attached :]
            m = next((wrong[h] for w in taken if (h := (w >> 32) & 0xFFFFFFFF) in wrong), None)
            if m is None or seq_id == m.seq.seq_id:
                continue
            what = f"KV integrity: it wrote into page {m.page_id}, another request's (position {m.position})"
            if seq_id in in_step:
                mismatches.found.append(PageMismatch(in_step[seq_id], "stamp", detail=what))
            else:
                self.faults.setdefault(seq_id, what)

    def check_pages(self, batch: ForwardBatch, expected: list[int], sealed: list[int]) -> PageFindings:
        """This pool's half of `check`, against expectations made on rank 0 (`_expected`): the step
        check of `batch`'s tensors and, in full mode, the sampled-bytes hashes of `sealed` pages."""
        passed = self._passed(batch, expected, sealed)
        if passed is not None:
            return PageFindings(None, passed[0], False, slot_stamps=passed[1])
        return self._findings(batch, expected, sealed)

    def _passed(
        self, batch: ForwardBatch, expected: list[int], sealed: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(write tags, slot stamps) when one C call (`batch_check`) says `batch` passes every check of
        `check_pages`; None when it does not, or cannot run here: `_findings` then checks part by part."""
        if not self._batch_check.applies:
            return None
        tensors = BatchTensors(batch.block_tables, batch.context_lens, batch.positions, batch.slot_mapping)
        answer = self._batch_check(tensors, expected, sealed)
        return None if answer is None or answer[0] else answer[1:]

    def _findings(self, batch: ForwardBatch, expected: list[int], sealed: list[int]) -> PageFindings:
        """`check_pages` part by part: each check's flags, which name what failed."""
        self._flush()
        num_rows, width = batch.block_tables.shape
        expected_t = torch.tensor(expected, dtype=torch.int64).to(self.device, non_blocking=True)
        num_tokens = batch.positions.shape[0]
        tags, lens, rows, positions, writers, read_lens = expected_t.split(
            [num_rows * width, num_rows, num_tokens, num_tokens, num_rows * width, num_rows]
        )
        inputs = StepCheckInputs(
            self.page_tags, batch.block_tables, batch.context_lens, batch.positions, batch.slot_mapping,
            tags.view(num_rows, width), lens, rows, positions,
        )  # fmt: skip
        page_writers = writers.view(num_rows, width) if self.stamps is not None else None
        is_bad, write_tags, slot_stamps = check_step(
            inputs, self.page_size, page_writers, backend=self.backend
        )
        findings = PageFindings(is_bad, write_tags, is_bad.any())
        if self.stamps is not None:
            assert page_writers is not None
            findings.bad_reads = check_stamps(self.stamps, batch.block_tables, page_writers, read_lens)
            findings.any_bad = findings.any_bad | (findings.bad_reads >= 0).any()
            findings.slot_stamps = slot_stamps
            findings.stamps, findings.block_tables = self.stamps, batch.block_tables
        if self.is_full and sealed:
            findings.found, findings.recorded = self.rehash(sealed)
            findings.is_changed = (findings.recorded != NO_BYTE_HASH) & (findings.found != findings.recorded)
            findings.any_bad = findings.any_bad | findings.is_changed.any()
        return findings

    def confirm_drafts(self, seq: Request, first: int, stop: int) -> None:
        """Positions `first` to `stop` - 1 of `seq` hold drafts verification accepted: their slots' stamps
        lose `DRAFT_MARK` (a rejected draft's slot keeps it, so a step that reads it before it is rewritten
        is stopped)."""
        holding = self.holdings.get(seq.seq_id)
        if self.stamps is None or holding is None or first >= stop:
            return
        size = self.page_size
        positions = range(first, stop)
        pages = [holding.pages[p // size] for p in positions]
        stamps = [holding.writers[p // size] ^ p for p in positions]
        self.restamp(pages, [p % size for p in positions], stamps)
        if self.restamps is not None:
            self.restamps += zip(pages, [p % size for p in positions], stamps, strict=True)

    def restamp(self, pages: list[int], offsets: list[int], stamps: list[int]) -> None:
        """Slot `offsets[i]` of page `pages[i]` carries `stamps[i]` in every checked layer (`confirm_drafts`;
        at --tp N on the ranks past 0, rank 0's confirmations, `integrity.ranks`)."""
        assert self.stamps is not None
        pages_t, offsets_t, stamps_t = (
            torch.tensor(values, dtype=torch.int64).to(self.device) for values in (pages, offsets, stamps)
        )
        self.stamps[pages_t, offsets_t] = stamps_t[:, None]

    def guard(self, batch: ForwardBatch) -> ForwardBatch:
        """`batch` (which passed `check`) with its write guard: each write lands only if its page still
        carries the tag it was checked against when the write happens."""
        assert self._write_tags is not None and self._write_tags.shape == batch.slot_mapping.shape
        return batch.guarded(WriteGuard(self.page_tags, self._write_tags), self._slot_stamps)

    def after_step(self, is_forward_run: bool) -> None:
        """End of a step: hash the pages sealed in it now that the forward wrote them (full mode); pages
        of requests stopped before it were unhashed already."""
        pages = [p for p in self.sealed_now if self._host[p] != FREE_TAG] if is_forward_run else []
        self.sealed_now.clear()
        self._write_tags = self._slot_stamps = None
        self.hash_pages(pages)

    def hash_pages(self, pages: list[int]) -> None:
        """Record the sampled-bytes hash of `pages` as they are now (full mode; a no-op otherwise)."""
        if self.is_full and pages:
            pages_t = torch.tensor(pages, dtype=torch.int64).to(self.device)
            self.byte_hashes[pages_t] = self._hash(pages_t)

    def mirror_tags(self, pages: list[int], tags: list[int]) -> None:
        """A tensor-parallel rank past 0: rank 0's tag changes to this pool's table (`integrity.ranks`);
        a page whose tag changed has no recorded hash until the forward that seals it hashes it."""
        if not pages:
            return
        pages_t = torch.tensor(pages, dtype=torch.int64)
        self.host_tags[pages_t] = torch.tensor(tags, dtype=torch.int64)
        self._is_dirty = True
        self._flush()
        if self.is_full:
            self.byte_hashes[pages_t.to(self.device)] = NO_BYTE_HASH

    def after_import(self) -> None:
        """Pages were written outside a forward (K/V transferred from another engine, `kv_transfer`):
        their tags go to the device table and the pages sealed for them are hashed now (full mode)."""
        self._flush()
        self.after_step(is_forward_run=True)

    # -- internals --------------------------------------------------------------------------------------
    def on_take(self, seq: Request, page_id: int) -> None:
        super().on_take(seq, page_id)
        if self.is_full:
            self.byte_hashes[page_id] = NO_BYTE_HASH  # its old bytes' hash says nothing about the new ones

    def _query_lens(self, seqs: list[Request], is_prefill: bool) -> list[int]:
        """New tokens per request: one in decode; in prefill, all after the pages it attached."""
        if not is_prefill:
            return [1] * len(seqs)
        size, holdings, none = self.page_size, self.holdings, Holding()
        return [s.num_tokens - holdings.get(s.seq_id, none).num_attached * size for s in seqs]

    def _flush(self) -> None:
        """The step's tag changes to the device table in one copy."""
        if self._is_dirty and self.page_tags is not self.host_tags:
            self.page_tags.copy_(self.host_tags)
        self._is_dirty = False

    def _expected(
        self,
        seqs: list[Request],
        query_lens: list[int],
        width: int,
        is_prefill: bool,
        lens: list[int] | None = None,
    ) -> list[int]:
        """Flat `[B * width + B + T + T + B * width + B]`: each row's tags (0-padded), each row's token
        count, each new token's row and position, then each row's writer tags (what its pages' stamps
        carry; 0-padded, and 0 for a page another request writes in this very step) and how many of its
        positions the step reads before writing (`check_stamps`). `lens`: each row's context length, if
        not its token count (a verification's counts its drafts)."""
        expected: list[int] = []
        holdings, none = self.holdings, Holding()
        held = [holdings.get(seq.seq_id, none) for seq in seqs]
        for holding in held:
            tags = holding.tags[:width]  # a row shorter than the holding: `screen` stops those first
            expected += tags
            expected += [FREE_TAG] * (width - len(tags))
        lens = [seq.num_tokens for seq in seqs] if lens is None else lens
        expected += lens
        if len(query_lens) == sum(query_lens):  # decode, the hot path: one token each, the last
            expected += range(len(seqs))
            expected += [n - 1 for n in lens]
        else:
            for b, query_len in enumerate(query_lens):
                expected += [b] * query_len
            for n, query_len in zip(lens, query_lens, strict=True):
                expected += range(n - query_len, n)
        sealed_now = self.sealed_now if is_prefill else {}  # a decode step attaches nothing
        for seq, holding in zip(seqs, held, strict=True):
            writers = holding.writers[:width]
            attached = holding.pages[: holding.num_attached]
            if sealed_now and any(sealed_now.get(p, seq.seq_id) != seq.seq_id for p in attached):
                writers = [  # attached pages another request of this prefill writes: read after its store
                    0 if sealed_now.get(p, seq.seq_id) != seq.seq_id else w
                    for p, w in zip(holding.pages, writers, strict=False)
                ]
            expected += writers
            expected += [FREE_TAG] * (width - len(writers))
        expected += [n - q for n, q in zip(lens, query_lens, strict=True)]
        return expected

    def _hash(self, pages: torch.Tensor) -> torch.Tensor:
        assert self.pool_bytes is not None and self.sample is not None
        sample = self.sample
        return sampled_page_hash(self.pool_bytes, pages, sample.offsets, sample.coeffs, backend=self.backend)

    def rehash(self, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sampled-bytes hash of `pages` now, the hash recorded after their sealing forward)."""
        pages_t = torch.tensor(pages, dtype=torch.int64).to(self.device)
        return self._hash(pages_t), self.byte_hashes[pages_t]
