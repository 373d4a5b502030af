"""Which KV page holds which tokens: a free list, reference counts, and prefix sharing by hash chain.

Every page allocation, sealing (a page becomes full and gets its hash), freeing and block-table change
happens here, in paired verbs: `can_allocate`/`allocate`/`deallocate` for admission, `can_append`/
`may_append` for decode. A full page's hash is `chain_hash(previous page's hash, its token ids)`, so
`page_hashes(seq.token_ids)` is the identity each page of `seq.block_table` should have; a prefix hit is
re-checked against the stored token ids before it is shared. Imports kvq.runtime.sequence only.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import deque
from collections.abc import Sequence as Tokens
from dataclasses import dataclass

from kvq.runtime.sequence import Sequence

ROOT_HASH = 0  # the "previous hash" of a sequence's first page


def chain_hash(previous: int, token_ids: Tokens[int]) -> int:
    """64-bit hash of (previous page hash, this page's token ids)."""
    digest = hashlib.blake2b(previous.to_bytes(8, "little") + array("q", token_ids).tobytes(), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def page_hashes(token_ids: Tokens[int], page_size: int) -> list[int]:
    """The chain hash of every full page of `token_ids`, in order."""
    hashes, previous = [], ROOT_HASH
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        previous = chain_hash(previous, token_ids[start : start + page_size])
        hashes.append(previous)
    return hashes


@dataclass
class Page:
    page_id: int
    ref_count: int = 0
    hash: int | None = None  # set when sealed: full, with its tokens known
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        self.page_size, self.enable_prefix_caching = page_size, enable_prefix_caching
        self.pages = [Page(i) for i in range(num_pages)]
        self.free_page_ids: deque[int] = deque(range(num_pages))  # freed pages keep their hash until reused
        self.hash_to_page_id: dict[int, int] = {}
        self.num_prefix_hits = 0  # pages shared instead of computed, since creation

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def num_free_pages(self) -> int:
        return len(self.free_page_ids)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- admission ------------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        """Enough free pages for all of `seq`'s tokens (prefix hits not counted) plus `reserve` more."""
        return self.num_free_pages >= self.pages_for(seq.num_tokens) + reserve

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` pages for all its tokens, sharing full prefix pages already in the pool.

        Only full pages before the last token can be shared (the last token must be computed for its
        logits). New full pages are sealed now: their K/V is written in this same step, before any
        later step can read them.
        """
        assert not seq.block_table, f"sequence {seq.seq_id} already has pages"
        previous, is_hitting, num_cached = ROOT_HASH, self.enable_prefix_caching, 0
        num_shareable = (seq.num_tokens - 1) // self.page_size
        for i in range(self.pages_for(seq.num_tokens)):
            token_ids = tuple(seq.token_ids[i * self.page_size : (i + 1) * self.page_size])
            is_full = len(token_ids) == self.page_size
            page_hash = chain_hash(previous, token_ids) if is_full else None
            page = self._lookup(page_hash, token_ids) if is_hitting and i < num_shareable else None
            if page is not None:
                if page.ref_count == 0:
                    self.free_page_ids.remove(page.page_id)
                page.ref_count += 1
                num_cached += self.page_size
                self.num_prefix_hits += 1
            else:
                is_hitting = False
                page = self._take_free_page()
                if page_hash is not None:
                    self._seal(page, page_hash, token_ids)
            seq.block_table.append(page.page_id)
            previous = page_hash if page_hash is not None else previous
        seq.num_cached_tokens = num_cached

    def deallocate(self, seq: Sequence) -> None:
        """Drop `seq`'s references; pages nobody uses go back to the free list (keeping their hash)."""
        for page_id in reversed(seq.block_table):
            page = self.pages[page_id]
            page.ref_count -= 1
            assert page.ref_count >= 0, f"page {page_id} freed twice"
            if page.ref_count == 0:
                self.free_page_ids.append(page_id)
        seq.block_table.clear()
        seq.num_cached_tokens = 0

    # -- decode ---------------------------------------------------------------------------------------
    def can_append(self, seq: Sequence) -> bool:
        """Room for the K/V of `seq`'s last token (a free page when it starts a new one)."""
        return len(seq.block_table) >= self.pages_for(seq.num_tokens) or self.num_free_pages >= 1

    def may_append(self, seq: Sequence) -> None:
        """Make room for the last token's K/V; seal the last page when that token fills it."""
        if len(seq.block_table) < self.pages_for(seq.num_tokens):
            seq.block_table.append(self._take_free_page().page_id)
        if seq.num_tokens % self.page_size == 0:
            previous = self.pages[seq.block_table[-2]].hash if len(seq.block_table) > 1 else ROOT_HASH
            assert previous is not None, "pages before the last one are sealed"
            token_ids = tuple(seq.token_ids[-self.page_size :])
            self._seal(self.pages[seq.block_table[-1]], chain_hash(previous, token_ids), token_ids)

    # -- pages ----------------------------------------------------------------------------------------
    def _lookup(self, page_hash: int | None, token_ids: tuple[int, ...]) -> Page | None:
        """The sealed page with this hash whose tokens really are `token_ids` (hashes can collide)."""
        page_id = self.hash_to_page_id.get(page_hash) if page_hash is not None else None
        if page_id is None or self.pages[page_id].token_ids != token_ids:
            return None
        return self.pages[page_id]

    def _take_free_page(self) -> Page:
        page = self.pages[self.free_page_ids.popleft()]
        assert page.ref_count == 0
        if page.hash is not None and self.hash_to_page_id.get(page.hash) == page.page_id:
            del self.hash_to_page_id[page.hash]  # its old content is about to be overwritten
        page.hash, page.token_ids, page.ref_count = None, (), 1
        return page

    def _seal(self, page: Page, page_hash: int, token_ids: tuple[int, ...]) -> None:
        page.hash, page.token_ids = page_hash, token_ids
        if self.enable_prefix_caching:
            self.hash_to_page_id[page_hash] = page.page_id
