"""The checked pool on an MLA model (the tiny glm_moe_dsa: latent rows and DSA index key rows share each
page slot): every fault of the drill is caught in the lowest mode meant to catch it, before the bad slot
or page is read, and stops only the requests it hit; every other request's tokens equal a fault-free run's
that repeats the same departures, and so do its fp32 logits, except where the fault changes which batch
wrote a prefix page a later request attaches (a stale entry costs c's first page its hits, a flipped
shared page leaves the cache, a stopped prefill's requeued sharer recomputes): the tiny GLM's K/V bytes
are not bit-equal across batches (seen; the llama's are), so there only the later waves' tokens are
compared, and wave 0's logits still are; no page leaks. `full`'s sampled bytes cover both parts of a
slot, the latent and the index keys (a flipped bit in either stops the request).
fp32 reference mode, pages of 4 tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvq.drill.fault_injector import FaultInjector
from kvq.drill.faults import FAULTS, Fault
from kvq.drill.workload import DrillRun, drill_engine, request_names, run_drill, waves
from kvq.runtime.engine import Engine
from kvq.runtime.kv_layout import LatentLayout

PAGE_SIZE = 4
CHANGES_PREFIX_WRITER = {"stale_prefix_hit", "bit_flip_shared", "prefix_unwritten", "slot_one_off_prefill"}


make_engine = drill_engine


@pytest.fixture(scope="module")
def glm(tiny_checkpoint) -> Path:
    return tiny_checkpoint("glm_moe_dsa", "bf16")


@pytest.fixture(scope="module")
def clean(glm: Path) -> DrillRun:
    return run_drill(make_engine(glm, "off"))


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_each_fault_stops_only_the_hit_request(glm: Path, fault: Fault) -> None:
    engine = make_engine(glm, fault.mode)
    assert isinstance(engine.kv_pool.layout, LatentLayout) and engine.kv_pool.layout.index_head_dim > 0
    run = run_drill(engine, fault)
    replay = run_drill(make_engine(glm, "off"), departures=run.departures)
    assert run.error is None and run.errored == set(fault.hit) and run.num_aborts == len(fault.hit)
    assert (run.num_repairs > 0) == fault.is_repaired
    for name in fault.hit:
        assert not run.is_read_after_fault(name), f"{name} was in a forward after the fault"
        assert (run.outputs[name].error or "").startswith("KV integrity: ")
    others = request_names(PAGE_SIZE) - set(fault.hit) - set(fault.aborted)
    compared = others if fault.name not in CHANGES_PREFIX_WRITER else others & set(waves(PAGE_SIZE)[0])
    for name in others:
        assert run.outputs[name].finish_reason == "length"
        assert run.outputs[name].token_ids == replay.outputs[name].token_ids, name
        if name in compared:
            assert run.logits[name] == replay.logits[name], f"{name}'s fp32 logits differ"
    manager = engine.block_manager
    assert manager.num_free_pages == manager.num_pages and sum(p.ref_count for p in manager.pages) == 0


def sampled_byte_in(engine: Engine, part: str) -> int:
    """A byte offset `full` mode samples inside a slot's latent (`part` "latent") or index key bytes."""
    layout = engine.kv_pool.layout
    assert (
        isinstance(layout, LatentLayout) and engine.tracker is not None and engine.tracker.sample is not None
    )
    for offset in engine.tracker.sample.offsets.tolist():
        is_latent = offset % layout.row_bytes < layout.latent_bytes
        if is_latent == (part == "latent"):
            return offset
    raise AssertionError(f"no sampled byte in the {part} part")


@pytest.mark.slow
@pytest.mark.parametrize("part", ["latent", "index_keys"])
def test_full_mode_sees_a_flipped_bit_in_either_part_of_a_slot(glm: Path, clean: DrillRun, part: str) -> None:
    def flip(injector: FaultInjector, ids: dict[str, int]) -> int:
        page = injector.running(ids["e"]).block_table[0]
        injector.bit_flip(page, byte_offset=sampled_byte_in(injector.engine, part), bit=6)
        return page

    run = run_drill(make_engine(glm, "full"), Fault(f"bit_flip_{part}", "full", ("e",), flip))
    assert run.errored == {"e"} and "sampled-bytes hash" in (run.outputs["e"].error or "")
    for name in clean.outputs.keys() - {"e"}:
        assert run.outputs[name].token_ids == clean.outputs[name].token_ids, name
