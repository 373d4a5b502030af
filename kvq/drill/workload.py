"""Fault drills: a small concurrent workload, one injected fault mid-run, and what came of it.

Five requests (a and b share two prefix pages, a finishes after three tokens; c and d share two others;
e stands alone; greedy and seeded sampling mixed); after `STEPS_BEFORE_FAULT` steps the fault is
injected and a late request is queued (in every run alike, with or without a fault). Every model forward
is recorded (the request ids in it, through an engine token hook), so a drill shows whether a hit request
was read after the fault. `FAULTS` lists each fault of `FaultInjector` with the mode that catches it and
the requests it must stop. Used by the tests (tiny llama) and `kvq bench integrity`. Imports torch and
kvq.runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvq.drill.fault_injector import FaultInjector
from kvq.runtime.engine import Engine, RequestOutput
from kvq.runtime.sampling import SamplingParams
from kvq.runtime.sequence import Sequence

STEPS_BEFORE_FAULT = 5
MAX_STEPS = 10_000

Inject = Callable[[FaultInjector, dict[str, int]], int]  # returns the page the failed check must name


@dataclass(frozen=True)
class Fault:
    name: str
    mode: str  # the lowest --kv-integrity mode that catches it
    hit: tuple[str, ...]  # the requests it must stop (by workload name)
    inject: Inject


def workload(page_size: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """The drill's requests by name, shaped by `page_size` (token ids below 1,000)."""
    prefix_ab = [100 + i for i in range(2 * page_size + 1)]  # two full shareable pages
    prefix_cd = [300 + i for i in range(2 * page_size + 1)]
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    return {
        "a": (prefix_ab + [11, 12], SamplingParams(max_tokens=3, ignore_eos=True)),
        "b": (prefix_ab + [21, 22, 23], greedy),
        "c": (prefix_cd + [31], SamplingParams(max_tokens=16, temperature=0.9, seed=3, ignore_eos=True)),
        "d": (prefix_cd + [41, 42], greedy),
        "e": (
            [500 + i for i in range(page_size + 2)],
            SamplingParams(max_tokens=16, temperature=0.9, seed=5, ignore_eos=True),
        ),
    }


def late_request(page_size: int) -> tuple[list[int], SamplingParams]:
    return [700 + i for i in range(2 * page_size + 1)], SamplingParams(max_tokens=8, ignore_eos=True)


def _table(injector: FaultInjector, ids: dict[str, int], name: str) -> list[int]:
    return injector.running(ids[name]).block_table


def _premature_free(injector: FaultInjector, ids: dict[str, int]) -> int:
    return injector.premature_free(ids["e"], 0)


def _double_free(injector: FaultInjector, ids: dict[str, int]) -> int:
    page = _table(injector, ids, "b")[0]  # a, which shared it, has finished: b holds the only reference
    injector.double_free(page)
    return page


def _stale_prefix_hit(injector: FaultInjector, ids: dict[str, int]) -> int:
    page = _table(injector, ids, "c")[0]  # the late request's first page will be c's
    page_size = injector.block_manager.page_size
    injector.stale_prefix_hit(page, late_request(page_size)[0][:page_size])
    return page


def _off_by_one(injector: FaultInjector, ids: dict[str, int]) -> int:
    return injector.off_by_one(ids["d"], 2)


def _misdirected_write(injector: FaultInjector, ids: dict[str, int]) -> int:
    injector.misdirected_write(ids["e"], ids["c"], 0)
    return _table(injector, ids, "c")[0]


def _stray_write(injector: FaultInjector, ids: dict[str, int]) -> int:
    page = _table(injector, ids, "e")[0]
    injector.stray_write(page, 1, _table(injector, ids, "c")[0], 1)
    return page


def _bit_flip(injector: FaultInjector, ids: dict[str, int]) -> int:
    page = _table(injector, ids, "e")[0]
    injector.bit_flip(page)
    return page


def _bit_flip_shared(injector: FaultInjector, ids: dict[str, int]) -> int:
    page = _table(injector, ids, "c")[0]  # held by c and d: both would read it
    injector.bit_flip(page)
    return page


FAULTS = (
    Fault("premature_free", "tags", ("e",), _premature_free),
    Fault("double_free", "tags", ("b",), _double_free),
    Fault("stale_prefix_hit", "tags", ("late",), _stale_prefix_hit),
    Fault("off_by_one", "tags", ("d",), _off_by_one),
    Fault("misdirected_write", "tags", ("e",), _misdirected_write),
    Fault("stray_write", "full", ("e",), _stray_write),
    Fault("bit_flip", "full", ("e",), _bit_flip),
    Fault("bit_flip_shared", "full", ("c", "d"), _bit_flip_shared),
)


@dataclass
class DrillRun:
    ids: dict[str, int]  # request id by workload name
    outputs: dict[str, RequestOutput] = field(default_factory=dict)  # final output by name
    forwards: list[set[int]] = field(default_factory=list)  # request ids in each model forward
    num_forwards_before_fault: int = 0
    fault_page: int | None = None  # the page the fault's failed check must name
    num_aborts: int = 0  # engine.stats.integrity_aborts during the run

    @property
    def errored(self) -> set[str]:
        return {name for name, out in self.outputs.items() if out.finish_reason == "error"}

    def is_read_after_fault(self, name: str) -> bool:
        """Whether request `name` was in any model forward after the fault was injected."""
        return any(self.ids[name] in ids for ids in self.forwards[self.num_forwards_before_fault :])


def run_drill(engine: Engine, fault: Fault | None = None) -> DrillRun:
    """The drill workload to completion on `engine`, `fault` injected after STEPS_BEFORE_FAULT steps."""
    page_size = engine.block_manager.page_size
    run = DrillRun(ids={name: engine.add_request(*request) for name, request in workload(page_size).items()})
    names = {request_id: name for name, request_id in run.ids.items()}
    aborts_before = engine.stats.integrity_aborts

    def record(seqs: list[Sequence], logits: torch.Tensor, token_ids: list[int]) -> None:
        run.forwards.append({s.seq_id for s in seqs})  # the requests this step's forward computed

    engine.token_hooks.append(record)
    try:
        for step in range(MAX_STEPS):
            if step == STEPS_BEFORE_FAULT:
                run.num_forwards_before_fault = len(run.forwards)
                if fault is not None:
                    run.fault_page = fault.inject(FaultInjector(engine), run.ids)
                run.ids["late"] = engine.add_request(*late_request(page_size))
                names[run.ids["late"]] = "late"
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    run.outputs[names[out.request_id]] = out
    finally:
        engine.token_hooks.remove(record)
    run.num_aborts = engine.stats.integrity_aborts - aborts_before
    return run
