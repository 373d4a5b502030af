"""What a failed step check found, request by request, and the message that names it.

Kinds: "read" (a block-table entry whose page does not carry the request's tag, or names a page past
what it holds), "slot" (a new token's position or slot is not its own), "length" (the context length or
new-token count attention would use is not the request's), "bookkeeping" (a slip a block-manager hook
saw, or holdings and token counts that disagree), "bytes" (a sealed page's sampled bytes changed).
Imports torch and kvq.runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from kvq.runtime.batch import ForwardBatch
from kvq.runtime.integrity.tags import FREE_TAG, format_tag
from kvq.runtime.sequence import Sequence

MismatchKind = Literal["read", "slot", "length", "bookkeeping", "bytes"]


@dataclass(frozen=True)
class PageMismatch:
    seq: Sequence
    kind: MismatchKind
    logical_index: int | None = None
    page_id: int | None = None
    expected: int | None = None  # a tag, hash, length or slot, by kind
    found: int | None = None  # None: the page id is not a page of the pool
    position: int | None = None  # "slot": the token's position
    detail: str = ""  # "bookkeeping", "length" and "slot": what disagreed

    def message(self) -> str:
        """What failed, naming the page, its logical index and both values."""
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

    def __init__(self, seqs: list[Sequence], batch: ForwardBatch, num_pages: int, page_size: int) -> None:
        self.seqs, self.batch, self.num_pages, self.page_size = seqs, batch, num_pages, page_size
        self.found: list[PageMismatch] = []

    def check_lists(self, query_lens: list[int]) -> bool:
        """The batch's host lists against the requests' own counts (True: some disagree); attention's
        bound `max_context_len` must cover every context."""
        batch, lens = self.batch, [s.num_tokens for s in self.seqs]
        if batch.block_tables.shape[0] != len(self.seqs) or len(batch.query_lens) != len(self.seqs):
            self._length(self.seqs, f"a batch of {batch.block_tables.shape[0]} rows for {len(self.seqs)}")
            return True
        if batch.query_lens == query_lens and batch.context_lens_list == lens:
            if batch.max_context_len >= max(lens) and batch.positions.shape[0] == sum(query_lens):
                return False
        columns = zip(self.seqs, batch.query_lens, query_lens, batch.context_lens_list, strict=True)
        for seq, found_query, query_len, found_len in columns:
            if found_query != query_len or found_len != seq.num_tokens:
                self._length(
                    [seq],
                    f"attention was to read {found_len} tokens, {found_query} of them new, but the request "
                    f"holds {seq.num_tokens}, {query_len} of them new",
                )
        if not self.found:
            self._length(self.seqs, f"attention's bound {batch.max_context_len} is below a context")
        return True

    def from_step_check(
        self, is_bad: torch.Tensor, expected: list[int], tag_of: Callable[[int], int]
    ) -> None:
        """Turn `check_step`'s flags into mismatches (read back only on failure)."""
        batch, size = self.batch, self.page_size
        num_rows, width = batch.block_tables.shape
        num_entries, num_tokens = num_rows * width, batch.positions.shape[0]
        pages = batch.block_tables.flatten().tolist()
        token_base = num_entries + num_rows
        for k in is_bad.nonzero().flatten().tolist():
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

    def _length(self, seqs: list[Sequence], what: str) -> None:
        for seq in seqs:
            self.found.append(PageMismatch(seq, "length", detail=f"KV integrity: {what}"))

    def _slot(self, seq: Sequence, t: int, position: int, own_page: int) -> None:
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
