"""Which KV page holds which tokens: a free list, reference counts, and prefix sharing by hash chain.

Every page allocation, sealing (a page becomes full and gets its hash), freeing and block-table change
happens here, in paired verbs: `can_allocate`/`allocate`/`deallocate` for admission, `can_append`/
`may_append` for decode. A full page's hash is `chain_hash(previous page's hash, its token ids)`, so
`page_hashes(seq.token_ids)` is the identity each page of `seq.block_table` should have; a prefix hit is
re-checked against the stored token ids and against the page it follows (each sealing gets a serial, a
page records its predecessor's), so a hash collision can cost a hit but never share a wrong page. A
sequence chains its own pages' hashes (`seq.last_page_hash`), never reading them back from the shared
pages. With `--kv-integrity` on, a `TagTracker` is told of every take, attach, seal, free and
deallocation (`kvq.runtime.integrity.ledger`): it may refuse a seal (the block table names a page the
request was not given there) and a free (requests still hold the page), and it says which pages a
deallocation releases. With it off, `tracker` is None and only the bookkeeping asserts run.
Imports kvq.runtime.request (and kvq.runtime.integrity for types).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Tokens
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvq.runtime.request import Request

if TYPE_CHECKING:
    from kvq.runtime.integrity.tracker import TagTracker

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
    serial: int = 0  # this sealing's number (unique; 0: not sealed)
    parent: int = 0  # the serial of the page it follows in the sealing request (0: the first page)


class BlockManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool = True,
        tracker: TagTracker | None = None,
    ) -> None:
        self.page_size, self.enable_prefix_caching = page_size, enable_prefix_caching
        self.tracker = tracker
        self.pages = [Page(i) for i in range(num_pages)]
        self.free_page_ids: deque[int] = deque(range(num_pages))  # freed pages keep their hash until reused
        self.hash_to_page_id: dict[int, int] = {}
        self.num_prefix_hits = 0  # pages shared instead of computed, since creation
        self.num_seals = 0  # sealings so far (the last serial handed out)

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def num_free_pages(self) -> int:
        return len(self.free_page_ids)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- admission ------------------------------------------------------------------------------------
    def can_allocate(self, seq: Request, reserve: int = 0) -> bool:
        """Enough free pages for all of `seq`'s tokens (prefix hits not counted) plus `reserve` more."""
        return self.num_free_pages >= self.pages_for(seq.num_tokens) + reserve

    def allocate(self, seq: Request) -> None:
        """Give `seq` pages for all its tokens, sharing full prefix pages already in the pool.

        Only full pages before the last token can be shared (the last token must be computed for its
        logits). New full pages are sealed now: their K/V is written in this same step, before any
        later step can read them. A sequence that still needs its prompt's log-probabilities takes no hits
        (every prompt row must be computed); its pages are shared with later requests all the same.
        """
        assert not seq.block_table, f"sequence {seq.seq_id} already has pages"
        previous, num_cached = ROOT_HASH, 0
        is_hitting = self.enable_prefix_caching and not seq.needs_prompt_logprobs
        num_shareable = (seq.num_tokens - 1) // self.page_size
        for i in range(self.pages_for(seq.num_tokens)):
            token_ids = tuple(seq.token_ids[i * self.page_size : (i + 1) * self.page_size])
            is_full = len(token_ids) == self.page_size
            page_hash = self.hash_page(previous, token_ids) if is_full else None
            page = None
            if is_hitting and i < num_shareable:
                page = self._lookup(page_hash, token_ids, seq.last_page_serial)
            if page is not None:
                assert page_hash is not None, "only full pages are looked up"
                if page.ref_count == 0:
                    self.free_page_ids.remove(page.page_id)
                page.ref_count += 1
                num_cached += self.page_size
                self.num_prefix_hits += 1
                seq.last_page_serial = page.serial
                if self.tracker is not None:  # its expected tag: from seq's own tokens
                    self.tracker.on_attach(seq, page.page_id, page_hash)
            else:
                is_hitting = False
                page = self._take_free_page(seq)
                if page_hash is not None:
                    self._seal(seq, i, page, page_hash, token_ids)
            seq.block_table.append(page.page_id)
            previous = page_hash if page_hash is not None else previous
        seq.num_cached_tokens, seq.last_page_hash = num_cached, previous
        seq.num_sealed_pages = seq.num_tokens // self.page_size

    def deallocate(self, seq: Request) -> None:
        """Drop `seq`'s references; pages nobody uses go back to the free list (keeping their hash).

        With a tracker the references dropped are the pages `seq` was given, as the tracker recorded
        them, not what its block table names (a wrong entry names a page `seq` holds no reference to).
        """
        pages = seq.block_table if self.tracker is None else self.tracker.on_deallocate(seq)
        for page_id in reversed(pages):
            self.release_page(page_id)
        seq.block_table.clear()
        seq.num_cached_tokens, seq.last_page_hash, seq.last_page_serial = 0, ROOT_HASH, 0
        seq.num_sealed_pages = 0

    # -- decode ---------------------------------------------------------------------------------------
    def can_append(self, seq: Request, num_lookahead: int = 0) -> bool:
        """Room for the K/V of `seq`'s last token and `num_lookahead` drafts after it (free pages for the
        ones they start)."""
        needed = self.pages_for(seq.num_tokens + num_lookahead) - len(seq.block_table)
        return needed <= 0 or self.num_free_pages >= needed

    def may_append(self, seq: Request, num_lookahead: int = 0) -> None:
        """Make room for the K/V of the last token and of `num_lookahead` drafts after it (their pages are
        not hashed: `truncate` gives back what verification rejects); seal every page `seq`'s own tokens
        filled since the last call (the last token's K/V is written this step, before a later one reads).

        Without a tracker a block table that does not hold exactly the pages of `seq`'s tokens stops the
        engine here (an assert), before any forward reads it; with one, the step's check stops `seq`.
        """
        num_pages = self.pages_for(seq.num_tokens + num_lookahead)
        while self.pages_for(seq.num_tokens) - 1 <= len(seq.block_table) < num_pages:
            seq.block_table.append(self._take_free_page(seq).page_id)
        if len(seq.block_table) != num_pages:
            assert self.tracker is not None, (
                f"sequence {seq.seq_id}: {len(seq.block_table)} pages for {seq.num_tokens} tokens"
            )
            return
        for index in range(seq.num_sealed_pages, seq.num_tokens // self.page_size):
            token_ids = tuple(seq.token_ids[index * self.page_size : (index + 1) * self.page_size])
            page_hash = self.hash_page(seq.last_page_hash, token_ids)
            page_id = seq.block_table[index]
            seq.num_sealed_pages = index + 1
            if not 0 <= page_id < self.num_pages:
                assert self.tracker is not None, f"sequence {seq.seq_id}: page {page_id} is not a page"
                self.tracker.on_seal(seq, index, page_id, page_hash)  # refused: seq is stopped
                return
            self._seal(seq, index, self.pages[page_id], page_hash, token_ids)
            seq.last_page_hash = page_hash

    def truncate(self, seq: Request) -> None:
        """After verification took back rejected drafts (`seq.token_ids` holds the accepted ones): the pages
        past those `seq`'s tokens need go back (never hashed: only drafts were in them); positions rolled
        back inside a kept page are rewritten before any step reads them. With a tracker the pages released
        are the ones `seq` was given there, as it recorded them (`on_truncate`)."""
        num_pages = self.pages_for(seq.num_tokens)
        if len(seq.block_table) <= num_pages:
            return
        released = seq.block_table[num_pages:]
        if self.tracker is not None:
            released = self.tracker.on_truncate(seq, num_pages)
        del seq.block_table[num_pages:]
        for page_id in reversed(released):
            self.release_page(page_id)

    # -- after a failed integrity check -----------------------------------------------------------------
    def unhash(self, page_id: int) -> None:
        """Take a page out of the prefix cache: its content is not what its hash says (or never written)."""
        page = self.pages[page_id]
        if page.hash is not None and self.hash_to_page_id.get(page.hash) == page_id:
            del self.hash_to_page_id[page.hash]
        page.hash, page.token_ids, page.serial = None, (), 0
        if self.tracker is not None:
            self.tracker.on_unhash(page_id, page.ref_count)

    def drop_entry(self, page_id: int, is_stale: Callable[[int], bool]) -> None:
        """Drop the prefix-cache entries naming `page_id` under a hash `is_stale` rejects (an entry that led a
        request to a page whose tag is not that hash's); the page's own entry is kept."""
        own = self.pages[page_id].hash
        stale = [h for h, p in self.hash_to_page_id.items() if p == page_id and h != own and is_stale(h)]
        for page_hash in stale:
            del self.hash_to_page_id[page_hash]

    # -- pages ----------------------------------------------------------------------------------------
    def hash_page(self, previous: int, token_ids: Tokens[int]) -> int:
        """A full page's identity: `chain_hash` (a method, so a drill can weaken it)."""
        return chain_hash(previous, token_ids)

    def _lookup(self, page_hash: int | None, token_ids: tuple[int, ...], parent: int) -> Page | None:
        """The sealed page with this hash whose tokens really are `token_ids` and that follows the page of
        serial `parent` (hashes can collide: a hit must be the very chain, not a look-alike)."""
        page_id = self.hash_to_page_id.get(page_hash) if page_hash is not None else None
        if page_id is None:
            return None
        page = self.pages[page_id]
        return page if page.token_ids == token_ids and page.parent == parent else None

    def _take_free_page(self, seq: Request) -> Page:
        """The next free page, for `seq`'s next logical page."""
        page = self.pages[self.free_page_ids.popleft()]
        assert page.ref_count == 0
        if page.hash is not None and self.hash_to_page_id.get(page.hash) == page.page_id:
            del self.hash_to_page_id[page.hash]  # its old content is about to be overwritten
        page.hash, page.token_ids, page.ref_count, page.serial = None, (), 1, 0
        if self.tracker is not None:
            self.tracker.on_take(seq, page.page_id)
        return page

    def release_page(self, page_id: int) -> None:
        """Drop one reference; the last one returns the page to the free list (with a tracker: unless
        requests still hold the page, then it keeps a reference for each)."""
        page = self.pages[page_id]
        if page.ref_count == 0 and self.tracker is not None:
            self.tracker.on_release_of_free_page(page_id)  # a double free: the page stays free, once
            return
        page.ref_count -= 1
        assert page.ref_count >= 0, f"page {page_id} freed twice"
        if page.ref_count == 0:
            num_holders = 0 if self.tracker is None else self.tracker.on_free(page_id, page.hash is not None)
            if num_holders:
                page.ref_count = num_holders
            else:
                self.free_page_ids.append(page_id)

    def _seal(self, seq: Request, index: int, page: Page, page_hash: int, token_ids: tuple[int, ...]) -> None:
        """`page`, `seq`'s logical page `index`, is full: it gets its chain hash (and a cache entry), and
        a serial that the page after it records; unless the tracker refuses (the request is stopped)."""
        if self.tracker is not None and not self.tracker.on_seal(seq, index, page.page_id, page_hash):
            return
        self.num_seals += 1
        page.hash, page.token_ids = page_hash, token_ids
        page.serial, page.parent, seq.last_page_serial = self.num_seals, seq.last_page_serial, self.num_seals
        if self.enable_prefix_caching:
            self.hash_to_page_id[page_hash] = page.page_id
