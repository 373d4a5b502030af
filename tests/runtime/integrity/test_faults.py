"""Every fault of the drill (`kvq.drill.faults`), in the lowest `--kv-integrity` mode meant to catch it, on
the tiny llama (GQA pages; the MLA pool is test_mla_faults.py): the requests it hits are stopped with
finish reason "error" before the bad slot or page is read by attention (they are in no forward after the
fault), with a message naming what failed; nobody else is stopped, and everyone else's tokens AND fp32
logits equal bit for bit those of a fault-free run that repeats the same departures (fp32 logits are
exact only for the same batch); no exception escapes `Engine.step`, every page comes back. fp32
reference mode, pages of 4 tokens."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvq.drill.faults import FAULTS, Fault
from kvq.drill.workload import DrillRun, drill_engine, request_names, run_drill
from kvq.runtime.engine import Engine

PAGE_SIZE = 4


make_engine = drill_engine


@pytest.fixture(scope="module")
def llama(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", "bf16")


def assert_contained(engine: Engine, run: DrillRun, fault: Fault, replay: DrillRun) -> None:
    """The drill's promises for one fault (see the module docstring); `replay`: the fault-free run that
    repeated `run`'s departures."""
    assert run.error is None, f"{fault.name}: {run.error!r}"
    assert run.errored == set(fault.hit), fault.name
    assert run.num_aborts == len(fault.hit)
    assert (run.num_repairs > 0) == fault.is_repaired
    assert set(run.outputs) == request_names(PAGE_SIZE) - set(fault.aborted)  # an abort has no output
    assert sorted(n for names in run.departures.aborted.values() for n in names) == sorted(fault.aborted)
    errors = [run.outputs[name].error or "" for name in fault.hit]
    for name, error in zip(fault.hit, errors, strict=True):
        assert not run.is_read_after_fault(name), f"{name} was in a forward after the fault"
        assert error.startswith("KV integrity: ") and error.endswith("the request was stopped"), error
    if fault.hit and run.fault_page is not None:  # some hit request's message names the page
        assert any(re.search(rf"\bpage {run.fault_page}\b", e) for e in errors), errors
    for name in request_names(PAGE_SIZE) - set(fault.hit) - set(fault.aborted):
        out = run.outputs[name]
        assert out.finish_reason == "length", (name, out.error)
        assert out.token_ids == replay.outputs[name].token_ids, name
        assert run.logits[name] == replay.logits[name], f"{name}'s fp32 logits differ"
    manager = engine.block_manager
    assert manager.num_free_pages == manager.num_pages, "a page leaked"
    assert len(set(manager.free_page_ids)) == manager.num_free_pages  # no page listed twice
    assert sum(page.ref_count for page in manager.pages) == 0


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_each_fault_stops_only_the_hit_request_before_it_reads(llama: Path, fault: Fault) -> None:
    engine = make_engine(llama, fault.mode)
    run = run_drill(engine, fault)
    replay = run_drill(make_engine(llama, "off"), departures=run.departures)
    assert_contained(engine, run, fault, replay)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault", [f for f in FAULTS if f.mode != "full"], ids=[f.name for f in FAULTS if f.mode != "full"]
)
def test_full_mode_catches_what_tags_does_alike(llama: Path, fault: Fault) -> None:
    """`full` runs every check of `tags` (and the sampled-bytes hashes): the same outcome."""
    engine = make_engine(llama, "full")
    run = run_drill(engine, fault)
    replay = run_drill(make_engine(llama, "off"), departures=run.departures)
    assert_contained(engine, run, fault, replay)


def test_a_fault_free_drill_runs_alike_in_every_mode(llama: Path) -> None:
    clean = run_drill(make_engine(llama, "off"))
    assert set(clean.outputs) == request_names(PAGE_SIZE)
    for mode in ("tags", "full"):
        engine = make_engine(llama, mode)
        run = run_drill(engine)
        assert {n: o.token_ids for n, o in run.outputs.items()} == {
            n: o.token_ids for n, o in clean.outputs.items()
        }
        assert run.logits == clean.logits
        assert not run.errored and run.num_aborts == 0 and run.num_repairs == 0
        assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


@pytest.mark.parametrize("name", ["stray_write", "bit_flip"])
def test_tags_mode_does_not_see_byte_faults(llama: Path, name: str) -> None:
    """A documented limitation: tags bind pages and slots to owners and positions, not to bytes. The
    corruption is real (e's tokens change) and passes unnoticed; `full` catches it (the test above)."""

    def flip_high_byte(injector, ids) -> int:  # the sign/exponent byte of slot 0's first K element
        page = injector.running(ids["e"]).block_table[0]
        injector.bit_flip(page, byte_offset=3, bit=6)
        return page

    fault = next(f for f in FAULTS if f.name == name)
    if name == "bit_flip":  # tags mode has no sample to pick a byte from
        fault = Fault(name, "full", ("e",), flip_high_byte)
    clean = run_drill(make_engine(llama, "off"))
    run = run_drill(make_engine(llama, "tags"), fault)
    assert run.num_aborts == 0 and not run.errored
    assert run.outputs["e"].token_ids != clean.outputs["e"].token_ids


@pytest.mark.parametrize("name", ["premature_free", "double_free", "off_by_one", "row_one_longer"])
def test_without_the_tracker_bookkeeping_faults_stop_the_engine(llama: Path, name: str) -> None:
    """What `off` leaves (it does no work): the block manager's bookkeeping asserts, which stop the whole
    engine when the slip surfaces (a page freed twice at a deallocation; a block table of the wrong
    length at the next append), not the faulty request alone."""
    fault = next(f for f in FAULTS if f.name == name)
    run = run_drill(make_engine(llama, "off"), fault, catch=True)
    assert isinstance(run.error, AssertionError)
    assert re.search(r"freed twice|pages for \d+ tokens", str(run.error)), run.error


def test_reset_kv_switches_the_mode_over_the_same_weights(llama: Path) -> None:
    """What `kvq bench integrity` uses to rotate the modes over its engines."""
    from kvq.errors import KvqError
    from kvq.runtime.sampling import SamplingParams

    engine = make_engine(llama, "off")
    params = SamplingParams(max_tokens=6)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 11, 12, 14, 15]]
    before = [out.token_ids for out in engine.generate(prompts, params)]
    assert engine.tracker is None and engine.block_manager.hash_to_page_id  # the shared prefix is cached
    model, kv_pool = engine.model, engine.kv_pool

    engine.reset_kv("tags")

    assert engine.config.kv_integrity == "tags" and engine.block_manager.tracker is engine.tracker is not None
    assert (
        engine.block_manager.hash_to_page_id == {} and engine.scheduler.block_manager is engine.block_manager
    )
    assert engine.model is model and engine.kv_pool is kv_pool
    assert [out.token_ids for out in engine.generate(prompts, params)] == before
    engine.add_request(prompts[0], params)
    with pytest.raises(KvqError, match="in flight"):
        engine.reset_kv("off")


def test_the_write_guard_is_what_stops_a_late_write(llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the guard the aborted request's late writes land in a page a wave-2 request is filling,
    and that request's logits change: the drill's late write is a real fault, caught by the guard alone."""
    import kvq.runtime.model_runner as model_runner

    fault = next(f for f in FAULTS if f.name == "late_write")
    monkeypatch.setattr(model_runner, "guard_slot_mapping", lambda tags, slots, write_tags, size: slots)
    run = run_drill(make_engine(llama, "tags"), fault)
    replay = run_drill(make_engine(llama, "off"), departures=run.departures)
    others = request_names(PAGE_SIZE) - set(fault.aborted)
    assert any(run.logits[name] != replay.logits[name] for name in others)


def test_a_stale_prefix_entry_is_dropped_with_the_request_it_misled(llama: Path) -> None:
    """After f is stopped for attaching the page a stale entry named, the next request with f's prompt
    computes its first page (no hit through that entry) and runs to its length."""
    from kvq.drill.workload import waves

    engine = make_engine(llama, "tags")
    fault = next(f for f in FAULTS if f.name == "stale_prefix_hit")
    run = run_drill(engine, fault)
    assert run.errored == {"f"}
    prompt, params = waves(PAGE_SIZE)[1]["f"]
    hits = engine.block_manager.num_prefix_hits
    (out,) = engine.generate([prompt], params)
    assert out.finish_reason == "length" and out.error is None
    assert out.token_ids == run_drill(make_engine(llama, "off")).outputs["f"].token_ids
    assert engine.block_manager.num_prefix_hits == hits  # its first page computed, not attached
