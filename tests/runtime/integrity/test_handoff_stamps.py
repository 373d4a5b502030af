"""Slot stamps across the prefill/decode handoff: a checked sender's page carries its stamps and writer tag
(an unchecked one's none); a page whose stamps are not its writer's is refused on arrival; a late import
copy (the decode side's copy of an aborted request's pages, landing after one of them went to another
request that is filling it) is caught before that request reads it, only it is stopped, a bystander's
tokens are unchanged and no page leaks; between processes (`serve.pd_link`: a socket and shared memory) the
stamps and writer tags travel with the pages and are checked alike. GQA (llama) and MLA (glm_moe_dsa) pools,
fp32, pages of 4."""

from __future__ import annotations

from multiprocessing import Pipe

import pytest
import torch

import kvq.runtime.pd_engine as pd_engine
from kvq.runtime.kv_transfer import KvTransferError, write_pages
from kvq.runtime.pd_engine import PDEngine
from kvq.runtime.sampling import SamplingParams
from kvq.serve.pd_link import receive_handoff, send_handoff
from tests.runtime.test_kv_transfer import engine, handoff_of

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPT = [100 + i for i in range(11)]  # K/V of 10 tokens: two full pages and one holding two


def test_a_page_whose_stamps_are_not_its_writers_is_refused(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama", "bf16")
    handoff = handoff_of(engine(path, kv_integrity="tags"), PROMPT)
    assert all(p.writer and p.stamps is not None for p in handoff.pages)
    stamps = handoff.pages[1].stamps
    assert stamps is not None
    stamps[2, 0] ^= 1 << 40  # a late write into the sender's page before it was exported
    with pytest.raises(KvTransferError, match="position 6 carries stamp"):
        engine(path, kv_integrity="tags").add_prefilled(handoff, GREEDY)  # type: ignore[attr-defined]


def test_stamps_cross_the_process_link_and_are_checked_on_arrival(tiny_checkpoint) -> None:
    """`send_handoff` / `receive_handoff` over a real connection and shared-memory segment: the receiver gets
    the sender's stamps and writer tags bit for bit, decodes what an in-process handoff decodes, and refuses
    a page whose stamp a late write changed before export."""
    path = tiny_checkpoint("llama", "bf16")
    handoff = handoff_of(engine(path, kv_integrity="tags"), PROMPT)
    sender, receiver = Pipe()

    def across(sent) -> object:  # noqa: ANN001
        send_handoff(sender, 7, sent, GREEDY)
        kind, request_id, meta, _, segment = receiver.recv()
        assert (kind, request_id) == ("handoff", 7)
        return receive_handoff(meta, segment)

    arrived = across(handoff)
    assert [(p.writer, p.tag) for p in arrived.pages] == [(p.writer, p.tag) for p in handoff.pages]
    assert all(p.writer for p in arrived.pages)
    assert all(torch.equal(a.stamps, p.stamps) for a, p in zip(arrived.pages, handoff.pages, strict=True))
    direct, linked = engine(path, kv_integrity="tags"), engine(path, kv_integrity="tags")
    outputs = []
    for decode, sent in ((direct, handoff), (linked, arrived)):
        decode.add_prefilled(sent, GREEDY)  # type: ignore[attr-defined]
        while decode.has_unfinished_requests():
            outputs += [o for o in decode.step() if o.finished]
    assert [o.finish_reason for o in outputs] == ["length", "length"]
    assert outputs[0].token_ids == outputs[1].token_ids
    stamps = handoff.pages[2].stamps
    assert stamps is not None
    stamps[1, 0] ^= 1 << 40  # a late write into the sender's partial page (position 9) before export
    with pytest.raises(KvTransferError, match="position 9 carries stamp"):
        engine(path, kv_integrity="tags").add_prefilled(across(handoff), GREEDY)  # type: ignore[attr-defined]


def test_only_a_checked_pool_sends_and_receives_stamps(tiny_checkpoint) -> None:
    """An unchecked sender (--kv-integrity off, no stamp in its pool) sends pages without stamps, which a
    checked receiver takes and stamps itself in the import copy; an unchecked receiver stamps nothing."""
    path = tiny_checkpoint("llama", "bf16")
    handoff = handoff_of(engine(path, kv_integrity="off"), PROMPT)
    assert [(p.writer, p.stamps) for p in handoff.pages] == [(0, None)] * 3
    outputs = {}
    for mode in ("off", "tags"):
        decode = engine(path, kv_integrity=mode)
        assert isinstance(decode, PDEngine) and decode.kv_pool.is_checked == (mode == "tags")
        decode.add_prefilled(handoff, GREEDY)
        decode.step()  # admitted: its pages copied in
        seq = decode.scheduler.running[0]
        if mode == "tags":
            assert decode.tracker is not None and decode.kv_pool.stamps is not None
            writers = decode.tracker.expected_writers(seq)
            stamps = decode.kv_pool.stamps[seq.block_table[1], :, 0].tolist()  # positions 4..7
            assert stamps == [writers[1] ^ p for p in range(4, 8)]
        while decode.has_unfinished_requests():
            outputs.setdefault(mode, []).extend(o.token_ids for o in decode.step() if o.finished)
    assert outputs["tags"] == outputs["off"] and len(outputs["off"][0]) == GREEDY.max_tokens


@pytest.mark.parametrize("arch", ["llama", "glm_moe_dsa"])
def test_a_late_import_copy_stops_only_the_pages_new_owner(tiny_checkpoint, monkeypatch, arch: str) -> None:
    path = tiny_checkpoint(arch, "bf16")
    handoff = handoff_of(engine(path, kv_integrity="tags"), PROMPT)
    decode = engine(path, kv_integrity="tags")
    assert isinstance(decode, PDEngine)
    copies: list[tuple] = []

    def recorded(pool, block_table, pages, first, writers=None) -> None:  # noqa: ANN001
        copies.append((pool, list(block_table), pages, first, writers))
        write_pages(pool, block_table, pages, first, writers)

    monkeypatch.setattr(pd_engine, "write_pages", recorded)
    request_id = decode.add_prefilled(handoff, GREEDY)
    decode.step()  # admitted: its pages copied in
    (copy,) = copies
    partial = copy[1][2]  # the page holding positions 8, 9: freed by the abort, not cached
    decode.abort(request_id)
    manager = decode.block_manager
    manager.free_page_ids.remove(partial)
    manager.free_page_ids.appendleft(partial)  # the next page taken
    victim = decode.add_request([500, 501], GREEDY)  # takes it as its page being filled
    bystander = decode.add_request([700 + i for i in range(6)], GREEDY)
    decode.step()  # their prefill: the victim wrote offsets 0 and 1 of that page
    assert decode.scheduler.running[0].block_table == [partial]
    write_pages(*copy)  # the import copy, behind schedule
    outputs = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                outputs[out.request_id] = out
    assert outputs[victim].finish_reason == "error"
    assert "carries stamp" in (outputs[victim].error or "")
    assert outputs[bystander].finish_reason == "length"
    clean = engine(path, kv_integrity="tags")
    (expected,) = clean.generate([[700 + i for i in range(6)]], GREEDY)
    assert outputs[bystander].token_ids == expected.token_ids
    assert manager.num_free_pages == manager.num_pages
