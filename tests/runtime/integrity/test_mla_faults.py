"""The checked pool on an MLA model (the tiny glm_moe_dsa: latent rows and DSA index key rows share each
page slot): the fault drill's every fault is caught in the mode that catches it and stops only the
requests it hit, and `full`'s sampled bytes cover both parts of a slot, the latent and the index keys
(a flipped bit in either stops the request). fp32 reference mode, pages of 4 tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvq.drill.fault_injector import FaultInjector
from kvq.drill.workload import FAULTS, DrillRun, Fault, run_drill
from kvq.runtime.engine import Engine
from kvq.runtime.kv_layout import LatentLayout
from tests.runtime.integrity.test_faults import make_engine


@pytest.fixture(scope="module")
def glm(tiny_checkpoint) -> Path:
    return tiny_checkpoint("glm_moe_dsa", "bf16")


@pytest.fixture(scope="module")
def clean(glm: Path) -> DrillRun:
    return run_drill(make_engine(glm, "off"))


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_each_fault_stops_only_the_hit_request(glm: Path, clean: DrillRun, fault: Fault) -> None:
    engine = make_engine(glm, fault.mode)
    assert isinstance(engine.kv_pool.layout, LatentLayout) and engine.kv_pool.layout.index_head_dim > 0
    run = run_drill(engine, fault)
    assert run.errored == set(fault.hit) and run.num_aborts == len(fault.hit)
    for name in fault.hit:
        assert not run.is_read_after_fault(name), f"{name} was in a forward after the fault"
        assert f"page {run.fault_page} (logical page " in (run.outputs[name].error or "")
    for name in clean.outputs.keys() - set(fault.hit):
        assert run.outputs[name].token_ids == clean.outputs[name].token_ids, name


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
