"""The checked KV pool's own record of who holds which page, kept from the block manager's primitive events
(take, attach, seal, free), never from the block tables it is there to check.

Per request, a `Holding`: the page each logical index was given (taken from the free list or attached
from the prefix cache), that page's allocation generation then, the tag the page must carry and the
writer tag its slots' stamps carry (the fill tag the page was taken with, by this request or, for an
attached page, by the one that filled it). Per page: its tag (a host mirror of the device tag table), the
generation and fill tag it was last taken with, and how many holdings name it. With these the block
manager's slips are checked where they happen:
- a seal: only the page the request was given for that index, still carrying its fill tag, is sealed;
  anything else is refused (the page keeps its tag, its rightful owner is untouched) and the request is
  stopped at its next check;
- a page's last reference dropped while holdings still name it (a premature or double free): the free
  is refused and the page keeps one reference per holder, so nobody's page is handed to another;
- a deallocation releases what the holding says the request was given, never what its (maybe wrong)
  block table names, and not a page taken by someone else since.
Every hook is total: an inconsistency is recorded against its request (`faults`), never raised.
Imports torch, numpy and kvq.runtime.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from kvq.runtime.integrity.tags import FREE_TAG, fill_tag, format_tag, sealed_tag
from kvq.runtime.request import Request

logger = logging.getLogger("kvq.integrity")


@dataclass
class Holding:
    """One request's pages, index by index, as the block manager gave them."""

    tags: list[int] = field(default_factory=list)  # the tag each logical page must carry
    pages: list[int] = field(default_factory=list)  # the page it was given (take or attach)
    generations: list[int] = field(default_factory=list)  # that page's generation when given
    writers: list[int] = field(default_factory=list)  # the writer tag its slots' stamps carry
    num_attached: int = 0  # prefix pages attached at admission: its prefill starts after them


class PageLedger:
    """Pages' tags and holders, requests' holdings, and the slips seen (the block manager's hooks)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.host_tags = torch.zeros(num_pages, dtype=torch.int64)  # [P]: every page free
        self._host = self.host_tags.numpy()  # scalar writes without a torch dispatch
        self._is_dirty = False
        self.generation = 0  # pages taken from the free list so far
        self._generation_of = np.zeros(num_pages, dtype=np.int64)  # [P]: when each page was last taken
        self._num_holders = np.zeros(num_pages, dtype=np.int64)  # [P]: holdings that name the page
        self._writer_of = np.zeros(num_pages, dtype=np.int64)  # [P]: the fill tag it was last taken with
        self.holdings: dict[int, Holding] = {}  # request id -> its pages
        self.faults: dict[int, str] = {}  # request id -> the first slip a hook saw (stopped at its check)
        self.sealed_now: dict[int, int] = {}  # page -> request id: sealed this step, written by its forward
        self.num_repairs = 0  # frees refused because a holder was left (see `on_free`)
        self.num_free_page_releases = 0  # releases of a page that was already free

    # -- hooks (block manager) ------------------------------------------------------------------------
    def on_take(self, seq: Request, page_id: int) -> None:
        """`page_id` left the free list to be `seq`'s next logical page: a new fill tag for both."""
        self.generation += 1
        holding = self.holdings.setdefault(seq.seq_id, Holding())
        tag = fill_tag(seq.seq_id, len(holding.tags), self.generation)
        self._give(holding, page_id, tag, self.generation, tag)
        self._generation_of[page_id] = self.generation
        self._writer_of[page_id] = tag
        self._host[page_id] = tag
        self._is_dirty = True

    def on_attach(self, seq: Request, page_id: int, page_hash: int) -> None:
        """`seq` shares sealed page `page_id`; `page_hash` is computed from `seq`'s own tokens."""
        holding = self.holdings.setdefault(seq.seq_id, Holding())
        generation, writer = int(self._generation_of[page_id]), int(self._writer_of[page_id])
        self._give(holding, page_id, sealed_tag(page_hash), generation, writer)
        holding.num_attached += 1

    def on_seal(self, seq: Request, index: int, page_id: int, page_hash: int) -> bool:
        """Whether `seq`'s logical page `index`, named `page_id` by its block table, may be sealed: only
        the page it was given there, still carrying the fill tag it was given with. If so, page and
        expectation become the chain hash's tag; if not, nothing changes and `seq` is marked."""
        holding = self.holdings.get(seq.seq_id)
        if holding is None or not 0 <= index < len(holding.tags):
            held = 0 if holding is None else len(holding.tags)
            return self._fault(seq, f"sealing logical page {index} of a request given {held} pages")
        given, tag = holding.pages[index], holding.tags[index]
        if page_id != given or not 0 <= page_id < self.num_pages or int(self._host[page_id]) != tag:
            found = int(self._host[page_id]) if 0 <= page_id < self.num_pages else None
            return self._fault(
                seq,
                f"its block table names page {page_id} (logical page {index}) at sealing, tag "
                f"{format_tag(found)}; it was given page {given} with tag {format_tag(tag)}",
            )
        tag = sealed_tag(page_hash)
        self._host[page_id] = tag
        self._is_dirty = True
        holding.tags[index] = tag
        self.sealed_now[page_id] = seq.seq_id
        return True

    def on_deallocate(self, seq: Request) -> list[int]:
        """`seq` gives its pages back (finished, stopped or preempted): the pages to release, in logical
        order; a page taken by another since it was given (a free slipped past) is not `seq`'s."""
        holding = self.holdings.pop(seq.seq_id, None)
        self.faults.pop(seq.seq_id, None)
        if holding is None:
            return []
        pages = []
        for page_id, generation in zip(holding.pages, holding.generations, strict=True):
            self._num_holders[page_id] -= 1
            if self._generation_of[page_id] == generation:
                pages.append(page_id)
        return pages

    def on_truncate(self, seq: Request, num_pages: int) -> list[int]:
        """Verification rejected drafts: `seq` keeps its first `num_pages` logical pages and gives back the
        rest (pages that held only drafts): those to release, as `on_deallocate` says for a deallocation."""
        holding = self.holdings.get(seq.seq_id)
        if holding is None or len(holding.pages) <= num_pages:
            return []
        pages = []
        given = zip(holding.pages[num_pages:], holding.generations[num_pages:], strict=True)
        for page_id, generation in given:
            self._num_holders[page_id] -= 1
            if self._generation_of[page_id] == generation:
                pages.append(page_id)
        for kept in (holding.tags, holding.pages, holding.generations, holding.writers):
            del kept[num_pages:]
        return pages

    def on_free(self, page_id: int, is_sealed: bool) -> int:
        """The block manager dropped the page's last reference. Returns how many holdings still name it:
        0, the page is free (a sealed one keeps its tag: a prefix hit may revive it); more, the free
        was one release too many and is refused (the page keeps that many references)."""
        num_holders = int(self._num_holders[page_id])
        if num_holders > 0:
            self.num_repairs += 1
            logger.warning(
                "page %d lost its last reference while %d request(s) still hold it (a premature or "
                "double free): it stays theirs",
                page_id,
                num_holders,
            )
            return num_holders
        if not is_sealed:
            self._host[page_id] = FREE_TAG
            self._is_dirty = True
        return 0

    def on_release_of_free_page(self, page_id: int) -> None:
        """A reference was dropped from a page that had none left; the block manager leaves it free."""
        self.num_free_page_releases += 1
        logger.warning("page %d was released while already free (a double free); it stays free", page_id)

    def on_unhash(self, page_id: int, ref_count: int) -> None:
        """The page left the prefix cache (content untrusted); free, it is no one's any more."""
        self.sealed_now.pop(page_id, None)
        if ref_count == 0:
            self._host[page_id] = FREE_TAG
            self._is_dirty = True

    # -- reading --------------------------------------------------------------------------------------
    def tag_of(self, page_id: int) -> int:
        return int(self._host[page_id])

    def expected_tags(self, seq: Request) -> list[int]:
        """The tag each of `seq`'s logical pages must carry, from its own tokens and allocations."""
        holding = self.holdings.get(seq.seq_id)
        return [] if holding is None else holding.tags

    def expected_writers(self, seq: Request) -> list[int]:
        """The writer tag each of `seq`'s logical pages' slot stamps must carry."""
        holding = self.holdings.get(seq.seq_id)
        return [] if holding is None else holding.writers

    def sealed_this_step(self, seq: Request) -> set[int]:
        """Pages `seq` sealed this step: their K/V is written by this step's forward, not before."""
        return {page for page, seq_id in self.sealed_now.items() if seq_id == seq.seq_id}

    def is_given(self, seq: Request, page_ids: set[int]) -> bool:
        """Whether `seq` was given (took or attached) any of `page_ids`."""
        holding = self.holdings.get(seq.seq_id)
        return holding is not None and not page_ids.isdisjoint(holding.pages)

    # -- internals ------------------------------------------------------------------------------------
    def _give(self, holding: Holding, page_id: int, tag: int, generation: int, writer: int) -> None:
        holding.tags.append(tag)
        holding.pages.append(page_id)
        holding.generations.append(generation)
        holding.writers.append(writer)
        self._num_holders[page_id] += 1

    def _fault(self, seq: Request, what: str) -> bool:
        """Record the first slip seen for `seq` (it is stopped at its next check); False, for the hooks."""
        if seq.seq_id not in self.faults:
            self.faults[seq.seq_id] = f"KV integrity: {what}"
            logger.error("request %d: %s", seq.seq_id, self.faults[seq.seq_id])
        return False
