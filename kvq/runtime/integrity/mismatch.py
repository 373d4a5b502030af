"""What a failed step check found, request by request, and the message that names it.

Kinds: "read" (a block-table entry whose page does not carry the request's tag, or names a page past
what it holds), "slot" (a new token's position or slot is not its own), "length" (the context length or
new-token count attention would use is not the request's), "bookkeeping" (a slip a block-manager hook
saw, or holdings and token counts that disagree), "bytes" (a sealed page's sampled bytes changed),
"stamp" (a slot the step reads carries another writer's stamp, or another position's).
Imports torch and kvq.runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvq.runtime.batch import ForwardBatch
from kvq.runtime.integrity.tags import FREE_TAG, format_tag
from kvq.runtime.request import Request

MismatchKind = Literal["read", "slot", "length", "bookkeeping", "bytes", "stamp"]


@dataclass(frozen=True)
class PageMismatch:
    seq: Request
    kind: MismatchKind
    logical_index: int | None = None
    page_id: int | None = None
    expected: int | None = None  # a tag, hash, length or slot, by kind
    found: int | None = None  # None: the page id is not a page of the pool
    position: int | None = None  # "slot": the token's position
    detail: str = ""  # "bookkeeping", "length" and "slot": what disagreed
    rank: int = 0  # the tensor-parallel rank whose pool or batch failed (`integrity.ranks`)

    def message(self) -> str:
        """What failed, naming the page, its logical index and both values (and the rank, past 0)."""
        text = self._what()
        if self.rank:
            text = text.replace("KV integrity: ", f"KV integrity: on tensor-parallel rank {self.rank}, ", 1)
        return text

    def _what(self) -> str:
        where = f"page {self.page_id} (logical page {self.logical_index})"
        if self.kind == "bytes":
            return (
                f"KV integrity: {where} sampled-bytes hash expected {format_tag(self.expected)}, found "
                f"{format_tag(self.found)}: its K/V changed after it was sealed"
            )
        if self.kind == "read" and self.expected == FREE_TAG:
            return (
                f"KV integrity: the block table names page {self.page_id} for logical page "
                f"{self.logical_index}, past the pages the request holds"
            )
        if self.kind == "read":
            return (
                f"KV integrity: {where} expected tag {format_tag(self.expected)}, found "
                f"{format_tag(self.found)}: the page is not this request's"
            )
        return self.detail


class StepMismatches:
    """Collects the failures of one step's check of `batch` (rows in the order of `seqs`)."""

    def __init__(self, seqs: list[Request], batch: ForwardBatch, num_pages: int, page_size: int) -> None:
        self.seqs, self.batch, self.num_pages, self.page_size = seqs, batch, num_pages, page_size
        self.found: list[PageMismatch] = []

    def check_lists(self, query_lens: list[int], lens: list[int] | None = None) -> bool:
        """The batch's host lists against the requests' own counts (True: some disagree): `lens`, each
        context's length, by default its request's tokens; attention's bound `max_context_len` must
        cover every context."""
        batch = self.batch
        lens = [s.num_tokens for s in self.seqs] if lens is None else lens
        if batch.block_tables.shape[0] != len(self.seqs) or len(batch.query_lens) != len(self.seqs):
            self._length(self.seqs, f"a batch of {batch.block_tables.shape[0]} rows for {len(self.seqs)}")
            return True
        if batch.query_lens == query_lens and batch.context_lens_list == lens:
            if batch.max_context_len >= max(lens) and batch.positions.shape[0] == sum(query_lens):
                return False
        columns = zip(self.seqs, batch.query_lens, query_lens, batch.context_lens_list, lens, strict=True)
        for seq, found_query, query_len, found_len, num_tokens in columns:
            if found_query != query_len or found_len != num_tokens:
                self._length(
                    [seq],
                    f"attention was to read {found_len} tokens, {found_query} of them new, but the request "
                    f"holds {num_tokens}, {query_len} of them new",
                )
        if not self.found:
            self._length(self.seqs, f"attention's bound {batch.max_context_len} is below a context")
        return True

    def from_step_check(self, bad: list[int], expected: list[int], tag_of: Callable[[int], int]) -> None:
        """Turn `check_step`'s flags (the indices set) into mismatches."""
        batch, size = self.batch, self.page_size
        num_rows, width = batch.block_tables.shape
        num_entries, num_tokens = num_rows * width, batch.positions.shape[0]
        pages = batch.block_tables.flatten().tolist()
        token_base = num_entries + num_rows
        for k in bad:
            if k < num_entries:
                row, index = divmod(k, width)
                page = pages[k]
                found = tag_of(page) if 0 <= page < self.num_pages else None
                self.found.append(PageMismatch(self.seqs[row], "read", index, page, expected[k], found))
            elif k < token_base:
                row = k - num_entries
                found_len = int(batch.context_lens[row])
                self._length(
                    [self.seqs[row]],
                    f"attention was to read {found_len} tokens but the request holds {expected[k]}",
                )
            else:
                t = k - token_base
                row, position = expected[token_base + t], expected[token_base + num_tokens + t]
                index = position // size
                own_page = pages[row * width + index] if 0 <= index < width else -1
                self._slot(self.seqs[row], t, position, own_page)

    def from_rehash(
        self, sealed: list[int], changed: list[int], found: list[int], recorded: list[int]
    ) -> None:
        """One mismatch per request holding each changed page (every holder would read it)."""
        for n in changed:
            for seq in self.seqs:
                for index, page in enumerate(seq.block_table[: seq.num_tokens // self.page_size]):
                    if page == sealed[n]:
                        self.found.append(PageMismatch(seq, "bytes", index, page, recorded[n], found[n]))

    def from_stamp_check(self, bad_reads: list[tuple[int, int, int, int]], expected: list[int]) -> None:
        """One "stamp" mismatch per row whose read slot carries another writer's stamp (a row the step
        check already failed is not named twice)."""
        num_rows, width = self.batch.block_tables.shape
        num_tokens, size = self.batch.positions.shape[0], self.page_size
        writers_at = num_rows * width + num_rows + 2 * num_tokens
        hit = {m.seq.seq_id for m in self.found}
        pages = self.batch.block_tables
        for row, position, layer, found in bad_reads:
            seq = self.seqs[row]
            if seq.seq_id in hit:
                continue
            index = position // size
            if index >= width:
                self._length([seq], f"attention was to read position {position}, past its block table")
                continue
            page = int(pages[row, index])
            writer = expected[writers_at + row * width + index]
            self.found.append(
                PageMismatch(
                    seq,
                    "stamp",
                    index,
                    page,
                    writer ^ position,
                    found,
                    position,
                    f"KV integrity: the slot of position {position} (page {page}, offset {position % size}) "
                    f"carries stamp {format_tag(found)} in layer {layer}, expected "
                    f"{format_tag(writer ^ position)}: written by {writer_name(found)}, not as this "
                    f"request's position {position}",
                )  # fmt: skip
            )

    def _length(self, seqs: list[Request], what: str) -> None:
        for seq in seqs:
            self.found.append(PageMismatch(seq, "length", detail=f"KV integrity: {what}"))

    def _slot(self, seq: Request, t: int, position: int, own_page: int) -> None:
        size = self.page_size
        slot, found_position = int(self.batch.slot_mapping[t]), int(self.batch.positions[t])
        own = own_page * size + position % size
        if found_position != position:
            what = f"the token at position {position} was given position {found_position}"
        else:
            what = (
                f"the K/V of position {position} was to be written to slot {slot} (page {slot // size}, "
                f"offset {slot % size}); its own is slot {own} (page {own_page}, offset {position % size})"
            )
        detail = f"KV integrity: {what}"
        self.found.append(
            PageMismatch(seq, "slot", position // size, slot // size, own, slot, position, detail)
        )


@dataclass(frozen=True)
class CheckedStep:
    """What a step's pages were checked against (made on rank 0 from the requests' own state): the flat
    expectations of `check_step` and, in full mode, the sealed pages the step reads."""

    expected: list[int]
    sealed: list[int]


@dataclass
class PageFindings:
    """One pool's check of one batch, on its device: `check_step`'s flags and write tags, and in full
    mode the sealed pages' sampled-bytes hashes now and as recorded."""

    is_bad: torch.Tensor | None  # [B * M + B + T] bool (None: the step passed, `batch_check`)
    write_tags: torch.Tensor  # [T] int64
    any_bad: torch.Tensor | bool  # [] bool
    found: torch.Tensor | None = None  # [len(sealed)] int64
    recorded: torch.Tensor | None = None
    is_changed: torch.Tensor | None = None
    bad_reads: torch.Tensor | None = None  # [B] int64: each row's first slot with a wrong stamp, or -1
    slot_stamps: torch.Tensor | None = None  # [T] int64: what the batch's writes stamp
    stamps: torch.Tensor | None = None  # [P + 1, page_size, L]: the pool's (read on failure only)
    block_tables: torch.Tensor | None = None

    def on_host(self) -> HostFindings:
        """The failures as plain lists (read back only on failure; what a rank past 0 sends rank 0)."""
        if not self.any_bad:
            return HostFindings()
        assert self.is_bad is not None
        changed = [] if self.is_changed is None else self.is_changed.nonzero().flatten().tolist()
        found = self.found.tolist() if changed and self.found is not None else []
        recorded = self.recorded.tolist() if changed and self.recorded is not None else []
        bad = self.is_bad.nonzero().flatten().tolist()
        return HostFindings(bad, changed, found, recorded, self._bad_reads())

    def _bad_reads(self) -> list[tuple[int, int, int, int]]:
        """(row, position, layer, stamp found) of each row's first slot whose stamp is not its own."""
        if self.bad_reads is None or self.stamps is None or self.block_tables is None:
            return []
        out = []
        stamps, tables = self.stamps, self.block_tables.cpu()
        page_size, width = stamps.shape[1], tables.shape[1]
        for row, position in enumerate(self.bad_reads.tolist()):
            if position < 0:
                continue
            index = position // page_size
            page = int(tables[row, index]) if index < width else -1
            if not 0 <= page < stamps.shape[0]:
                out.append((row, position, -1, 0))
                continue
            found = stamps[page, position % page_size].tolist()  # [L]
            out.append((row, position, *_odd_one(found)))
        return out


def writer_name(stamp: int) -> str:
    """Who a stamp says wrote it: its writer tag's high half (positions stay in the low one)."""
    return "no writer (never written)" if stamp == 0 else f"writer 0x{(stamp >> 32) & 0xFFFFFFFF:08x}..."


def _odd_one(found: list[int]) -> tuple[int, int]:
    """(layer, stamp) of the first layer whose stamp differs from the most common (all equal: layer 0)."""
    common = max(set(found), key=found.count)
    for layer, stamp in enumerate(found):
        if stamp != common:
            return layer, stamp
    return 0, common


@dataclass(frozen=True)
class HostFindings:
    """`PageFindings`' failures on the host: the flags set, the changed pages (indices into `sealed`)
    and every sealed page's hash found and recorded (when any changed)."""

    bad: list[int] = field(default_factory=list)
    changed: list[int] = field(default_factory=list)
    found: list[int] = field(default_factory=list)
    recorded: list[int] = field(default_factory=list)
    bad_reads: list[tuple[int, int, int, int]] = field(default_factory=list)  # `PageFindings._bad_reads`

    def __bool__(self) -> bool:
        return bool(self.bad or self.changed or self.bad_reads)

    def report(self, mismatches: StepMismatches, step: CheckedStep, tag_of: Callable[[int], int]) -> None:
        """Add the failures to `mismatches` (the batch they were found in)."""
        mismatches.from_step_check(self.bad, step.expected, tag_of)
        if self.changed:
            mismatches.from_rehash(step.sealed, self.changed, self.found, self.recorded)
        if self.bad_reads:
            mismatches.from_stamp_check(self.bad_reads, step.expected)
