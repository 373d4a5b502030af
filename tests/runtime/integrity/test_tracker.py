"""The tag tracker under the block manager: every take, attach, seal, free, revival and unhash leaves each
page's tag and each request's expectations consistent; the step check names the failing entries; `off`
builds no tracker at all."""

from __future__ import annotations

import torch

from kvq.runtime.batch import ForwardBatch
from kvq.runtime.block_manager import BlockManager, page_hashes
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.integrity import make_tracker
from kvq.runtime.integrity.tags import FREE_TAG, sealed_tag
from kvq.runtime.integrity.tracker import TagTracker
from kvq.runtime.model_runner import StepBatches
from kvq.runtime.request import Request
from kvq.runtime.sampling import SamplingParams

P = 4
CPU = torch.device("cpu")


def seq(token_ids: list[int], seq_id: int) -> Request:
    return Request(seq_id, list(token_ids), len(token_ids), SamplingParams(max_tokens=8), len(token_ids) + 8)


def manager(num_pages: int = 8) -> tuple[BlockManager, TagTracker]:
    tracker = TagTracker(num_pages, P, CPU)
    return BlockManager(num_pages, P, tracker=tracker), tracker


def prepare(seqs: list[Request], is_prefill: bool, num_pages: int = 8) -> ForwardBatch:
    """The batch the engine would check (a runner without a model: only `prepare` is used)."""
    return StepBatches(P, num_pages, 1, CPU).prepare(seqs, is_prefill)


def assert_consistent(tracker: TagTracker, *seqs: Request) -> None:
    for s in seqs:
        assert len(tracker.expected_tags(s)) == len(s.block_table)
        assert [tracker.tag_of(p) for p in s.block_table] == tracker.expected_tags(s)


def test_off_builds_no_tracker(tiny_checkpoint) -> None:
    engine = Engine(
        EngineConfig(model=str(tiny_checkpoint("llama", "bf16")), kv_memory="1MiB", page_size=P, threads=1)
    )
    assert engine.config.kv_integrity == "off"
    assert make_tracker("off", engine.kv_pool) is None
    assert engine.tracker is None and engine.block_manager.tracker is None
    out = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6
    assert not engine.scheduler.has_unfinished
    assert isinstance(make_tracker("tags", engine.kv_pool), TagTracker)
    full = make_tracker("full", engine.kv_pool)
    assert full is not None and full.sample is not None and full.pool_bytes is not None


def test_tags_follow_take_seal_share_and_free() -> None:
    m, tracker = manager()
    a, b = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], 0), seq([1, 2, 3, 4, 5, 6, 7, 8, 10, 11], 1)
    m.allocate(a)
    m.allocate(b)
    hashes = page_hashes(a.token_ids, P)
    assert tracker.expected_tags(a)[:2] == tracker.expected_tags(b)[:2] == [sealed_tag(h) for h in hashes]
    assert (
        tracker.expected_tags(a)[2] != tracker.expected_tags(b)[2]
    )  # fill tags: owner, logical page, generation
    assert_consistent(tracker, a, b)
    assert a.last_page_hash == hashes[-1]
    own = a.block_table[2]
    m.deallocate(a)
    assert tracker.tag_of(own) == FREE_TAG
    assert_consistent(tracker, b)
    prefix_pages = b.block_table[:2]
    m.deallocate(b)
    assert [tracker.tag_of(p) for p in prefix_pages] == [sealed_tag(h) for h in hashes]  # kept: revivable
    c = seq([1, 2, 3, 4, 5, 6, 7, 8, 12], 2)
    m.allocate(c)  # revives both sealed pages from the free list
    assert c.block_table[:2] == prefix_pages and c.num_cached_tokens == 2 * P
    assert_consistent(tracker, c)


def test_decode_seals_with_the_requests_own_chain() -> None:
    m, tracker = manager()
    s = seq([1, 2, 3, 4, 5, 6], 0)
    m.allocate(s)
    for token in (7, 8, 9, 10, 11):
        s.token_ids.append(token)
        m.may_append(s)
        assert_consistent(tracker, s)
    assert s.last_page_hash == page_hashes(s.token_ids, P)[-1]
    assert tracker.expected_tags(s)[:2] == [sealed_tag(h) for h in page_hashes(s.token_ids, P)]


def test_a_reused_sealed_page_gets_a_new_tag() -> None:
    m, tracker = manager(num_pages=3)
    a = seq([1, 2, 3, 4, 5], 0)
    m.allocate(a)
    sealed_page, old = a.block_table[0], tracker.expected_tags(a)[0]
    m.deallocate(a)
    assert tracker.expected_tags(a) == []  # a holds no pages: nothing is expected of it
    b = seq([20, 21, 22, 23, 24, 25, 26, 27, 28], 1)  # needs all three pages: takes the sealed one
    m.allocate(b)
    assert sealed_page in b.block_table and tracker.tag_of(sealed_page) not in (old, FREE_TAG)
    assert_consistent(tracker, b)


def test_a_free_of_a_held_page_is_refused_and_a_release_of_a_free_page_ignored() -> None:
    m, tracker = manager()
    a = seq([1, 2, 3, 4, 5], 0)
    m.allocate(a)
    page = a.block_table[0]
    m.release_page(page)  # one release too many: a still holds the page
    assert tracker.num_repairs == 1 and page not in m.free_page_ids and m.pages[page].ref_count == 1
    m.deallocate(a)  # a's own release frees it
    assert m.num_free_pages == 8 and sorted(m.free_page_ids) == list(range(8))
    m.release_page(page)  # now a release of a free page: it stays free, listed once
    assert tracker.num_free_page_releases == 1 and sorted(m.free_page_ids) == list(range(8))


def test_unhash_drops_the_cache_entry_and_frees_the_tag_of_an_unused_page() -> None:
    m, tracker = manager()
    a, b = seq([1, 2, 3, 4, 5], 0), seq([9, 8, 7, 6, 5], 1)
    m.allocate(a)
    m.allocate(b)
    m.unhash(a.block_table[0])
    assert m.pages[a.block_table[0]].hash is None and not any(
        p == a.block_table[0] for p in m.hash_to_page_id.values()
    )
    assert (
        tracker.tag_of(a.block_table[0]) == tracker.expected_tags(a)[0]
    )  # still held: its holder still checks
    page = b.block_table[0]
    m.deallocate(b)
    m.unhash(page)
    assert tracker.tag_of(page) == FREE_TAG


def test_the_check_names_every_failing_entry_length_position_and_slot() -> None:
    m, tracker = manager()
    a, b = seq([1, 2, 3, 4, 5, 6], 0), seq([11, 12, 13, 14, 15, 16, 17], 1)
    m.allocate(a)
    m.allocate(b)
    assert tracker.screen([a, b]) == [] and tracker.check([a, b], prepare([a, b], True)) == []
    own = a.block_table[0]
    a.block_table[0] = b.block_table[0]  # a reads b's first page (and writes its prompt there)
    (read,) = tracker.check([a, b], prepare([a, b], True))
    assert (read.seq, read.kind, read.logical_index, read.page_id) == (a, "read", 0, b.block_table[0])
    assert read.expected == tracker.expected_tags(a)[0] and read.found == tracker.expected_tags(b)[0]
    assert f"page {b.block_table[0]} (logical page 0) expected tag" in read.message()
    a.block_table[0] = 8  # not a page of the pool
    (read,) = tracker.check([a], prepare([a], True))
    assert read.found is None and "found no page" in read.message()
    a.block_table[0] = own

    def faulty(change) -> list:
        batch = prepare([a, b], False)
        change(batch)
        return tracker.check([a, b], batch)

    for s_ in (a, b):
        s_.token_ids.append(9)
        m.may_append(s_)
    (slot,) = faulty(lambda batch: batch.slot_mapping[1].sub_(1))  # b's write one slot back, same page
    assert (slot.seq, slot.kind, slot.position, slot.page_id) == (b, "slot", 7, b.block_table[1])
    assert "position 7 was to be written to slot" in slot.message() and "offset 2); its own" in slot.message()
    (position,) = faulty(lambda batch: batch.positions[0].add_(1))
    assert position.seq is a and "position 6 was given position 7" in position.message()
    (length,) = faulty(lambda batch: batch.context_lens[0].add_(1))
    assert (
        length.seq is a
        and length.kind == "length"
        and "read 8 tokens but the request holds 7" in (length.message())
    )


def test_a_seal_through_a_wrong_entry_is_refused_and_the_pages_owner_untouched() -> None:
    """Issue #20: sealing took whatever page the block table named and set both the page's tag and the
    request's expectation from it, so the wrong page looked right and its owner was the one stopped."""
    m, tracker = manager()
    a, b = seq([1, 2, 3, 4, 5, 6, 7], 0), seq([11, 12, 13, 14, 15, 16], 1)
    m.allocate(a)
    m.allocate(b)
    a_own, b_page, b_tag = a.block_table[1], b.block_table[1], tracker.expected_tags(b)[1]
    a.block_table[1] = b_page  # the page a's next token seals is b's
    a.token_ids.append(8)
    m.may_append(a)  # a's token fills logical page 1: refused
    assert m.pages[b_page].hash is None and tracker.tag_of(b_page) == b_tag
    assert tracker.expected_tags(b)[1] == b_tag and tracker.screen([b]) == []
    (hit,) = tracker.screen([a, b])
    assert hit.seq is a and hit.kind == "bookkeeping"
    assert f"names page {b_page} (logical page 1) at sealing" in hit.message()
    assert f"it was given page {a_own}" in hit.message()
    m.deallocate(a)  # gives back what a was given, not b's page
    assert m.pages[b_page].ref_count == 1 and m.pages[a_own].ref_count == 0
    assert m.num_free_pages == 8 - len(b.block_table)


def test_a_row_one_entry_longer_stops_its_request_without_raising() -> None:
    """Issue #20: an IndexError in the tracker's seal hook escaped Engine.step."""
    m, tracker = manager()
    a, b = seq([1, 2, 3], 0), seq([11, 12, 13, 14, 15], 1)
    m.allocate(a)
    m.allocate(b)
    a.block_table.append(b.block_table[0])  # one entry longer than a's pages
    a.token_ids.append(4)
    m.may_append(a)  # the token fills a's page 0; the extra entry is neither sealed nor taken
    assert (
        m.pages[b.block_table[0]].hash is not None
        and tracker.tag_of(b.block_table[0]) == (tracker.expected_tags(b)[0])
    )
    (hit,) = tracker.screen([a, b])
    assert hit.seq is a and "its block table names 2" in hit.message()
    a.block_table.pop()
    a.block_table.append(-1)  # in the batch: a row naming a page past what a holds is flagged too
    batch = prepare([a, b], False)
    a.block_table.pop()
    batch.block_tables[0, 1] = b.block_table[0]
    (read,) = tracker.check([a, b], batch)
    assert read.seq is a and "past the pages the request holds" in read.message()
    m.deallocate(a)
    assert m.pages[b.block_table[0]].ref_count == 1


def test_without_a_tracker_a_row_of_the_wrong_length_asserts_before_any_forward() -> None:
    m = BlockManager(8, P)
    a = seq([1, 2, 3], 0)
    m.allocate(a)
    a.block_table.append(5)
    a.token_ids.append(4)
    try:
        m.may_append(a)
    except AssertionError as error:
        assert "2 pages for 4 tokens" in str(error)
    else:
        raise AssertionError("may_append accepted a block table one entry too long")
