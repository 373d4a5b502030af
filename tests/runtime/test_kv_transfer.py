"""KV page handoff between two engines in one process (the prefill/decode split's core): greedy and seeded
outputs identical to one engine's in fp32 reference mode on GQA and MLA pages; the decode side's checked
pool tags the transferred pages right; a page whose bytes or tag changed in transit ends only its request;
workers that disagree on the KV cache are refused by field name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.integrity.tags import sealed_tag
from kvq.runtime.kv_transfer import KVHandoff, KvTransferError
from kvq.runtime.pd_engine import PDEngine, generate_split
from kvq.runtime.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def prompts(seed: int = 0) -> list[list[int]]:
    """One token (no page to send), below a page, at a page boundary and past it (page size 4); the last
    two share a 9-token prefix."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 2000, (9,), generator=gen).tolist()
    lengths = [1, 3, 8, 11, 13]
    out = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in lengths]
    out[-1] = prefix + out[-1][: 13 - 9]
    out[-2] = prefix + out[-2][: 11 - 9]
    return out


def engine(path: Path, cls: type[Engine] = PDEngine, **kwargs) -> Engine:
    options = {"dtype": "float32", "kv_memory": "4MiB", "page_size": 4, "threads": 1, **kwargs}
    return cls(EngineConfig(model=str(path), **options))


@pytest.mark.parametrize("arch", ["llama", "glm_moe_dsa"])
def test_split_outputs_equal_one_engines(tiny_checkpoint, arch: str) -> None:
    path = tiny_checkpoint(arch, "bf16")
    single = engine(path, Engine)
    expected = [o.token_ids for o in single.generate(prompts(), GREEDY)]
    prefill, decode = engine(path), engine(path, kv_integrity="full")
    outputs = generate_split(prefill, decode, prompts(), GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
    assert decode.stats.integrity_aborts == 0
    assert decode.stats.num_steps == GREEDY.max_tokens  # no prefill ran on the decode side
    assert decode.block_manager.num_free_pages == decode.kv_pool.num_pages
    assert prefill.block_manager.num_free_pages == prefill.kv_pool.num_pages


def test_seeded_sampling_continues_the_prefill_sides_stream(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama", "bf16")
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    expected = [o.token_ids for o in engine(path, Engine).generate(prompts(), params)]
    assert [o.token_ids for o in generate_split(engine(path), engine(path), prompts(), params)] == expected


def handoff_of(prefill: PDEngine, prompt: list[int]) -> KVHandoff:
    request_id = prefill.add_prefill_request(prompt, GREEDY)
    assert prefill.step() == []  # its output is the decode side's to give
    (handoff,) = prefill.take_handoffs().values()
    assert prefill.take_handoffs() == {} and not prefill.has_unfinished_requests()
    assert handoff.prompt_token_ids == prompt and request_id >= 0
    return handoff


def test_transferred_pages_carry_the_tags_the_decode_side_expects(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama", "bf16")
    prefill, decode = engine(path), engine(path, kv_integrity="tags")
    handoff = handoff_of(prefill, prompts()[3])  # 11 tokens: K/V of 10 in two full pages and a partial one
    assert [p.logical_index for p in handoff.pages] == [0, 1, 2]
    request_id = decode.add_prefilled(handoff, GREEDY)
    decode.step()  # admits it (pages copied in) and runs its first decode step
    (seq,) = decode.scheduler.running
    assert seq.seq_id == request_id
    tracker = decode.tracker
    assert tracker is not None
    assert [tracker.tag_of(p) for p in seq.block_table] == tracker.expected_tags(seq)
    assert [tracker.tag_of(p) for p in seq.block_table[:2]] == [p.tag for p in handoff.pages[:2]]
    assert handoff.pages[0].tag == sealed_tag(decode.block_manager.pages[seq.block_table[0]].hash or 0)


def corrupt_byte(handoff: KVHandoff) -> None:
    handoff.pages[1].data[0, 0, 5] ^= 0x10


def swap_pages(handoff: KVHandoff) -> None:
    handoff.pages[0].tag, handoff.pages[1].tag = handoff.pages[1].tag, handoff.pages[0].tag


@pytest.mark.parametrize(("damage", "found"), [(corrupt_byte, "bytes digest"), (swap_pages, "carries tag")])
def test_a_page_damaged_in_transit_ends_only_its_request(tiny_checkpoint, damage, found: str) -> None:
    path = tiny_checkpoint("llama", "bf16")
    expected = [o.token_ids for o in engine(path, Engine).generate(prompts(), GREEDY)]

    def in_transit(i: int, handoff: KVHandoff) -> None:
        if i == 2:
            damage(handoff)

    decode = engine(path)
    outputs = generate_split(engine(path), decode, prompts(), GREEDY, in_transit)
    assert outputs[2].finish_reason == "error" and not outputs[2].token_ids
    assert outputs[2].error is not None and found in outputs[2].error and "page" in outputs[2].error
    assert [o.token_ids for i, o in enumerate(outputs) if i != 2] == expected[:2] + expected[3:]
    assert decode.block_manager.num_free_pages == decode.kv_pool.num_pages


def test_workers_that_disagree_on_the_kv_cache_are_refused_by_name(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama", "bf16")
    handoff = handoff_of(engine(path), prompts()[1])
    with pytest.raises(KvTransferError, match=r"disagree on the KV cache .*page_size: 4 vs 8"):
        engine(path, page_size=8).add_prefilled(handoff, GREEDY)
    with pytest.raises(KvTransferError, match=r"model_type: llama vs glm4_moe"):
        engine(tiny_checkpoint("glm4_moe", "bf16")).add_prefilled(handoff, GREEDY)
