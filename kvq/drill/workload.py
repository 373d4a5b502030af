"""Fault drills: a small concurrent workload in three waves, one injected fault, and what came of it.

Wave 0 (step 0): a and b share two prefix pages (a finishes after three tokens), c and d two others, e
stands alone; greedy and seeded sampling mixed. Wave 1, queued at the fault step (every run alike, with
or without a fault): f, on fresh tokens; h on c's first page plus a page of its own, and i on the same two
pages, admitted in the same prefill (i attaches the page h seals in that step). Wave 2, two steps later:
j on h's two pages, and k on a's first page followed by h's second page's tokens (a look-alike under a
hash that forgets the chain). Pages hold `DRILL_PAGE_SIZE` tokens, which the faults' timing is worked
out for. Every model forward is recorded (request ids, and a digest of each request's fp32 logits),
through an engine token hook, so a drill shows whether a hit request was read after the fault and
whether everyone else's logits match a fault-free run bit for bit. Used by the tests (tiny llama,
tiny deepseek_v3) and `kvq bench integrity`. Imports torch and kvq.runtime.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvq.runtime.request import Request
from kvq.runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from kvq.drill.faults import Fault
    from kvq.runtime.engine import Engine
    from kvq.runtime.outputs import RequestOutput

DRILL_PAGE_SIZE = 4
STEPS_BEFORE_FAULT = 5
WAVE_STEPS = (0, STEPS_BEFORE_FAULT, STEPS_BEFORE_FAULT + 2)
MAX_STEPS = 10_000

Prompt = tuple[list[int], SamplingParams]


def waves(page_size: int) -> list[dict[str, Prompt]]:
    """The drill's requests by name, wave by wave (queued at `WAVE_STEPS`); token ids below 1,000."""
    prefix_ab = [100 + i for i in range(2 * page_size + 1)]  # two full shareable pages
    prefix_cd = [300 + i for i in range(2 * page_size + 1)]
    own_page = [600 + i for i in range(page_size)]  # h's second page, and k's look-alike
    greedy, short = (
        SamplingParams(max_tokens=16, ignore_eos=True),
        SamplingParams(max_tokens=8, ignore_eos=True),
    )
    return [
        {
            "a": (prefix_ab + [11, 12], SamplingParams(max_tokens=3, ignore_eos=True)),
            "b": (prefix_ab + [21, 22, 23], greedy),
            "c": (prefix_cd + [31], SamplingParams(max_tokens=16, temperature=0.9, seed=3, ignore_eos=True)),
            "d": (prefix_cd + [41, 42], greedy),
            "e": (
                [500 + i for i in range(page_size + 2)],
                SamplingParams(max_tokens=16, temperature=0.9, seed=5, ignore_eos=True),
            ),
        },
        {
            "f": ([700 + i for i in range(2 * page_size + 1)], short),
            "h": (prefix_cd[:page_size] + own_page + [61], short),
            "i": (prefix_cd[:page_size] + own_page + [62, 63], short),
        },
        {
            "j": (prefix_cd[:page_size] + own_page + [64], short),
            "k": (prefix_ab[:page_size] + own_page + [65], short),
        },
    ]


def drill_engine(model: str | Path, kv_integrity: str, tp: int = 1) -> Engine:
    """The tests' drill engine: fp32 (a request's greedy tokens do not depend on its batch), pages of
    `DRILL_PAGE_SIZE`, a 2 MiB pool (per rank at --tp N), one thread (two on a busy 2-core machine are 50x
    slower)."""
    from kvq.runtime.config import EngineConfig
    from kvq.runtime.engine import Engine

    config = EngineConfig(
        model=str(model),
        dtype="float32",
        kv_memory="2MiB",
        page_size=DRILL_PAGE_SIZE,
        kv_integrity=kv_integrity,
        threads=1,
        tp=tp,
    )
    return Engine(config)


def request_names(page_size: int) -> set[str]:
    return {name for wave in waves(page_size) for name in wave}


@dataclass
class Departures:
    """When requests left a run other than by finishing, by name: what a fault-free run must repeat to
    batch the same requests in every forward (fp32 logits are exact only for the same batch)."""

    preempted: list[str] = field(default_factory=list)  # preempted as the fault was injected
    stopped: dict[int, list[str]] = field(default_factory=dict)  # step -> stopped before its forward
    requeued: dict[int, list[str]] = field(default_factory=dict)  # step -> requeued before its forward
    aborted: dict[int, list[str]] = field(default_factory=dict)  # step -> aborted during it
    preempted_in_step: dict[int, list[str]] = field(
        default_factory=dict
    )  # step -> preempted after its forward


@dataclass
class DrillRun:
    ids: dict[str, int] = field(default_factory=dict)  # request id by workload name
    outputs: dict[str, RequestOutput] = field(default_factory=dict)  # final output by name
    tokens: dict[str, list[int]] = field(default_factory=dict)  # completion tokens so far, by name
    logits: dict[str, list[str]] = field(default_factory=dict)  # digest of each step's fp32 logits row
    forwards: list[set[int]] = field(default_factory=list)  # request ids in each model forward
    departures: Departures = field(default_factory=Departures)
    num_forwards_before_fault: int = 0
    fault_page: int | None = None  # the page the fault's failed check must name (if it names one)
    num_aborts: int = 0  # engine.stats.integrity_aborts during the run
    num_repairs: int = 0  # frees the tracker refused (held pages)
    error: BaseException | None = None  # what stopped the engine (only without a tracker)

    @property
    def errored(self) -> set[str]:
        return {name for name, out in self.outputs.items() if out.finish_reason == "error"}

    def is_read_after_fault(self, name: str) -> bool:
        """Whether request `name` was in any model forward after the fault was injected."""
        return any(self.ids[name] in ids for ids in self.forwards[self.num_forwards_before_fault :])


def logits_digest(row: torch.Tensor) -> str:
    """A digest of one logits row's exact values (as fp32)."""
    return hashlib.blake2b(row.float().contiguous().numpy().tobytes(), digest_size=16).hexdigest()


def run_drill(
    engine: Engine, fault: Fault | None = None, *, catch: bool = False, departures: Departures | None = None
) -> DrillRun:
    """The drill workload to completion on `engine`, `fault` injected before step STEPS_BEFORE_FAULT
    (once wave 1 is queued). `catch`: an exception that stops the engine (a bookkeeping assert without a
    tracker) ends the run and is kept in `error`, with the tokens and logits seen until then.
    `departures` (of a faulty run; for a fault-free one): the same requests leave at the same steps."""
    run, drill = DrillRun(), _Drill(engine, departures)
    engine.token_hooks.append(drill.record)
    try:
        for step in range(MAX_STEPS):
            drill.queue(run, step)
            if step == STEPS_BEFORE_FAULT:
                run.num_forwards_before_fault = len(drill.forwards)
                drill.inject(run, fault)
            if not engine.has_unfinished_requests():
                break
            drill.step(run, step)
    except Exception as error:  # noqa: BLE001  # kept for the caller, which asked for it
        if not catch:
            raise
        run.error = error
    finally:
        engine.token_hooks.remove(drill.record)
    run.forwards, run.logits = drill.forwards, drill.logits
    run.num_aborts = engine.stats.integrity_aborts - drill.aborts_before
    run.num_repairs = 0 if engine.tracker is None else engine.tracker.num_repairs
    return run


class _Drill:
    """One drill run's moving parts: its requests, what it records, the departures it repeats."""

    def __init__(self, engine: Engine, departures: Departures | None) -> None:
        self.engine, self.replay = engine, departures
        self.seqs: dict[str, Request] = {}
        self.names: dict[int, str] = {}
        self.forwards: list[set[int]] = []
        self.logits: dict[str, list[str]] = {}
        self.aborts_before = engine.stats.integrity_aborts
        self.mid_step_aborts: list[str] = []
        self.mid_step_preemptions: list[str] = []

    def record(self, seqs: list[Request], logits: torch.Tensor, token_ids: list[int]) -> None:
        self.forwards.append({s.seq_id for s in seqs})  # the requests this step's forward computed
        for seq, row in zip(seqs, logits.cpu(), strict=True):
            self.logits.setdefault(self.names[seq.seq_id], []).append(logits_digest(row))
        for name in self.mid_step_aborts:  # a fault-free run repeating a client's abort mid-step
            self.engine.abort(self.seqs[name].seq_id)
        for name in self.mid_step_preemptions:  # ... and a preemption right after a forward
            self.engine.scheduler.requeue(self.seqs[name])
        self.mid_step_aborts, self.mid_step_preemptions = [], []

    def queue(self, run: DrillRun, step: int) -> None:
        if step not in WAVE_STEPS:
            return
        for name, request in waves(self.engine.block_manager.page_size)[WAVE_STEPS.index(step)].items():
            run.ids[name] = self.engine.add_request(*request)
            self.seqs[name], self.names[run.ids[name]] = self.engine.scheduler.waiting[-1], name

    def inject(self, run: DrillRun, fault: Fault | None) -> None:
        from kvq.drill.fault_injector import FaultInjector

        before = self._preemptions()
        if fault is not None:
            injector = FaultInjector(self.engine)
            # a late fault lands inside some later forward: the forwards after that one read it
            injector.on_landed = lambda: setattr(run, "num_forwards_before_fault", len(self.forwards) + 1)
            run.fault_page = fault.inject(injector, run.ids)
        for name in self.replay.preempted if self.replay else ():
            FaultInjector(self.engine).preempt(self.seqs[name].seq_id)
        run.departures.preempted = [n for n, count in self._preemptions().items() if count > before[n]]

    def step(self, run: DrillRun, step: int) -> None:
        engine, replay = self.engine, self.replay
        held_back = []
        if replay is not None:
            for name in replay.stopped.get(step, []):
                engine.abort(self.seqs[name].seq_id)
            held_back = [self.seqs[n] for n in replay.requeued.get(step, [])]
            for seq in held_back:
                engine.scheduler.waiting.remove(seq)
            self.mid_step_aborts = list(replay.aborted.get(step, []))
            self.mid_step_preemptions = list(replay.preempted_in_step.get(step, []))
        before, running = self._preemptions(), {n for n, s in self.seqs.items() if s.finish_reason is None}
        num_forwards = len(self.forwards)
        for out in engine.step():
            name = self.names[out.request_id]
            run.tokens[name] = out.token_ids
            if out.finished:
                run.outputs[name] = out
        for seq in reversed(held_back):
            engine.scheduler.waiting.appendleft(seq)
        departures = run.departures
        in_forward = set().union(*self.forwards[num_forwards:])  # this step's forward, if it ran
        for name, count in self._preemptions().items():
            if count > before[name]:
                after_forward = self.seqs[name].seq_id in in_forward
                (departures.preempted_in_step if after_forward else departures.requeued).setdefault(
                    step, []
                ).append(name)
        for name in running:
            reason = self.seqs[name].finish_reason
            if reason == "error":
                departures.stopped.setdefault(step, []).append(name)
            elif reason == "abort":
                departures.aborted.setdefault(step, []).append(name)

    def _preemptions(self) -> dict[str, int]:
        return {name: seq.num_preemptions for name, seq in self.seqs.items()}
