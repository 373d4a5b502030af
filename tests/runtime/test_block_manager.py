"""Block manager: free list and reference counts, hash-chained prefix sharing re-checked on tokens and
on the page a hit follows, sealing."""

from __future__ import annotations

import pytest

from kvq.runtime import block_manager as bm
from kvq.runtime.block_manager import BlockManager, page_hashes
from kvq.runtime.request import Request
from kvq.runtime.sampling import SamplingParams

P = 4  # page size


def seq(token_ids: list[int], seq_id: int = 0) -> Request:
    return Request(seq_id, list(token_ids), len(token_ids), SamplingParams(max_tokens=8), len(token_ids) + 8)


def test_allocate_and_deallocate_return_every_page() -> None:
    m = BlockManager(num_pages=8, page_size=P)
    s = seq(list(range(10)))  # 3 pages
    assert m.can_allocate(s) and not m.can_allocate(s, reserve=6)
    m.allocate(s)
    assert len(s.block_table) == 3 and m.num_free_pages == 5
    assert all(m.pages[p].ref_count == 1 for p in s.block_table)
    m.deallocate(s)
    assert s.block_table == [] and m.num_free_pages == 8


def test_shared_prefix_pages_are_reference_counted() -> None:
    m = BlockManager(num_pages=8, page_size=P)
    a, b = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], 0), seq([1, 2, 3, 4, 5, 6, 7, 8, 10, 11], 1)
    m.allocate(a)
    m.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == 2 * P and a.num_cached_tokens == 0
    assert [m.pages[p].ref_count for p in b.block_table] == [2, 2, 1]
    m.deallocate(a)
    assert [m.pages[p].ref_count for p in b.block_table] == [1, 1, 1]
    assert m.num_free_pages == 8 - 3


def test_the_page_holding_the_last_token_is_never_shared() -> None:
    m = BlockManager(num_pages=8, page_size=P)
    a, b = seq(list(range(8)), 0), seq(list(range(8)), 1)  # exactly two full pages each
    m.allocate(a)
    m.allocate(b)
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert b.num_cached_tokens == P


def test_freed_pages_keep_their_hash_and_can_be_hit_again() -> None:
    m = BlockManager(num_pages=4, page_size=P)
    a = seq(list(range(9)), 0)
    m.allocate(a)
    first_pages = list(a.block_table)
    m.deallocate(a)
    b = seq(list(range(9)), 1)
    m.allocate(b)
    assert b.block_table[:2] == first_pages[:2] and b.num_cached_tokens == 2 * P
    assert m.num_free_pages == 4 - 3


def test_a_hash_hit_is_rechecked_against_the_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm, "chain_hash", lambda previous, token_ids: 42)  # every page collides
    m = BlockManager(num_pages=8, page_size=P)
    a, b = seq([1, 2, 3, 4, 5], 0), seq([9, 9, 9, 9, 5], 1)
    m.allocate(a)
    m.allocate(b)
    assert b.num_cached_tokens == 0 and set(a.block_table).isdisjoint(b.block_table)


def test_reusing_a_freed_page_drops_its_stale_hash() -> None:
    m = BlockManager(num_pages=2, page_size=P)
    a = seq([1, 2, 3, 4, 5], 0)
    m.allocate(a)
    m.deallocate(a)
    b = seq([7, 7, 7, 7, 7], 1)  # takes both pages, overwriting a's sealed first page
    m.allocate(b)
    m.deallocate(b)
    c = seq([1, 2, 3, 4, 5], 2)
    m.allocate(c)
    assert c.num_cached_tokens == 0


def test_prefix_caching_off_shares_nothing() -> None:
    m = BlockManager(num_pages=8, page_size=P, enable_prefix_caching=False)
    a, b = seq(list(range(9)), 0), seq(list(range(9)), 1)
    m.allocate(a)
    m.allocate(b)
    assert set(a.block_table).isdisjoint(b.block_table) and b.num_cached_tokens == 0


def test_append_takes_a_page_at_the_boundary_and_seals_full_pages() -> None:
    m = BlockManager(num_pages=3, page_size=P)
    s = seq([1, 2, 3])
    m.allocate(s)
    for token in range(4, 13):  # up to 12 tokens: three full pages
        s.token_ids.append(token)
        assert m.can_append(s)
        m.may_append(s)
        assert len(s.block_table) == m.pages_for(s.num_tokens)
    # the sealed pages carry the hash chain a request's page identity is derived from
    assert [m.pages[p].hash for p in s.block_table] == page_hashes(s.token_ids, P)
    assert m.num_free_pages == 0
    s.token_ids.append(13)  # a fourth page is needed and none is free
    assert not m.can_append(s)


def test_page_hashes_chain_over_previous_pages() -> None:
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], P)[1] != page_hashes([0, 2, 3, 4, 5, 6, 7, 8], P)[1]
    assert len(page_hashes(list(range(9)), P)) == 2


def test_a_hash_collision_never_shares_a_wrong_page() -> None:
    """With a hash that forgets the chain (every page hashed on its own tokens), b's second page has
    a's hash and tokens but follows another first page: it is not shared, in any mode (the hit is
    checked against the page it follows). Pages that really are the same prefix still are."""
    m = BlockManager(num_pages=16, page_size=P)
    forgetful = lambda previous, token_ids: bm.chain_hash(bm.ROOT_HASH, token_ids)  # noqa: E731
    m.hash_page = forgetful  # type: ignore[method-assign]
    tail = [5, 6, 7, 8]
    a, b = seq([1, 2, 3, 4, *tail, 9], 0), seq([11, 12, 13, 14, *tail, 9], 1)
    m.allocate(b)
    m.allocate(a)  # a's second page now owns the (colliding) cache entry
    d = seq([1, 2, 3, 4, *tail, 11], 3)  # a's own prefix: both pages shared
    m.allocate(d)
    assert d.block_table[:2] == a.block_table[:2] and d.num_cached_tokens == 2 * P
    c = seq([11, 12, 13, 14, *tail, 10], 2)  # b's prefix: its first page is b's, its second is not a's
    m.allocate(c)
    assert c.block_table[0] == b.block_table[0] and c.num_cached_tokens == P
    assert c.block_table[1] not in (a.block_table[1], b.block_table[1])  # computed (b's lost the entry)


def test_a_sequence_chains_its_own_page_hashes() -> None:
    """may_append seals from `seq.last_page_hash`, never from what the shared previous page says."""
    m = BlockManager(num_pages=4, page_size=P)
    s = seq([1, 2, 3, 4, 5])
    m.allocate(s)
    m.pages[s.block_table[0]].hash = 12345  # a shared page's hash changed under it
    for token in (6, 7, 8):
        s.token_ids.append(token)
        m.may_append(s)
    assert m.pages[s.block_table[1]].hash == page_hashes(s.token_ids, P)[1] == s.last_page_hash
