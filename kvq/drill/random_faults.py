"""Faults the drill was not tuned to: a seed picks the slip (one of the injector's primitives), the request
it hits, the logical page, the page or slot it names and the offset, all at random, injected at the
drill's fault step in `tags` mode; `classify` says what came of it against a fault-free run that
repeats the same departures.

Outcomes: "caught" (only the target request, or the two of a swap, stopped before it was read after
the fault; everyone else's tokens and fp32 logits identical), "harmless" (nobody stopped and every
request's tokens and logits identical: the slip was repaired, or named what was there anyway), and the
failures "missed" (nobody else hurt, but a request's own output changed unnoticed), "leaked" (another
request's output changed, or a request outside the slip was stopped), "read late" (stopped, but after
a forward that read what the slip named) and "crashed" (an exception left
`Engine.step`), plus "page leak" (pages not all back at the end). Byte faults are `full`'s and sampled
(`page_sample`), so they are not drawn here. Imports kvq.drill and kvq.runtime.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvq.drill.fault_injector import FaultInjector
from kvq.drill.faults import Fault, Ids
from kvq.drill.workload import DrillRun
from kvq.runtime.batch import ForwardBatch
from kvq.runtime.engine import Engine

KINDS = (
    "replace_entry",
    "swap_entries",
    "off_by_one",
    "premature_free",
    "double_free",
    "append_entry",
    "slot_shift",
    "position_shift",
    "context_shift",
    "misdirected_write",
)
TARGETS = ("b", "c", "d", "e")  # running in decode at the fault step (a has finished)


@dataclass(frozen=True)
class RandomFault:
    fault: Fault  # its `hit`: the requests the slip is in (the target, and a swap's partner)
    target: str
    drawn: list[str]  # what was drawn at injection, to reproduce or report it

    def describe(self) -> str:
        return f"{self.fault.name}: target {self.target} {' '.join(self.drawn)}".strip()


def random_fault(seed: int) -> RandomFault:
    """The slip seed `seed` draws (every draw made when it is injected, from the pool as it is then)."""
    rng = random.Random(seed)
    kind, target, other = rng.choice(KINDS), rng.choice(TARGETS), rng.choice(TARGETS)
    partner = other if kind == "swap_entries" and other != target else None
    hit = (target,) if partner is None else (target, partner)
    drawn: list[str] = []

    def inject(injector: FaultInjector, ids: Ids) -> None:
        _inject(injector, ids, rng, kind, target, partner, drawn)

    return RandomFault(Fault(f"random_{seed}_{kind}", "tags", hit, inject), target, drawn)


def _inject(
    injector: FaultInjector,
    ids: Ids,
    rng: random.Random,
    kind: str,
    target: str,
    partner: str | None,
    drawn: list[str],
) -> None:
    seq = injector.running(ids[target])
    table, num_pages = seq.block_table, injector.block_manager.num_pages
    index = rng.randrange(len(table))
    page = rng.randrange(num_pages)
    delta = rng.choice([d for d in range(-4, 5) if d])
    drawn.append(f"index {index} page {page} delta {delta}")
    if kind == "replace_entry":
        injector.replace_entry(ids[target], index, page)
    elif kind == "swap_entries":
        other = ids[partner or target]
        other_index = rng.randrange(len(injector.running(other).block_table))
        injector.swap_entries(ids[target], index, other, other_index)
    elif kind == "off_by_one":
        injector.off_by_one(ids[target], index)
    elif kind == "premature_free":
        injector.premature_free(ids[target], index)
    elif kind == "double_free":
        injector.double_free(table[index])
    elif kind == "append_entry":
        injector.append_entry(ids[target], page)
    elif kind == "slot_shift":
        injector.change_next_batch(ids[target], lambda b, row, t: _shift(b, "slot_mapping", t, delta))
    elif kind == "position_shift":
        injector.change_next_batch(ids[target], lambda b, row, t: _shift(b, "positions", t, delta))
    elif kind == "context_shift":
        injector.context_one_too_long(ids[target], delta)
    else:  # misdirected_write: the new token's K/V to a random slot of the pool
        slot = page * injector.block_manager.page_size + rng.randrange(injector.block_manager.page_size)
        injector.change_next_batch(ids[target], lambda b, row, t: _set(b, t, slot))


def _shift(batch: ForwardBatch, name: str, token: int, delta: int) -> ForwardBatch:
    getattr(batch, name)[token] = max(int(getattr(batch, name)[token]) + delta, 0)
    return batch


def _set(batch: ForwardBatch, token: int, slot: int) -> ForwardBatch:
    batch.slot_mapping[token] = slot
    return batch


def classify(engine: Engine, run: DrillRun, replay: DrillRun, fault: Fault) -> str:
    """What came of one random fault (see the module docstring)."""
    if run.error is not None:
        return "crashed"
    manager = engine.block_manager
    if manager.num_free_pages != manager.num_pages or any(p.ref_count for p in manager.pages):
        return "page leak"
    names = set(replay.logits) | set(run.logits)
    changed = {n for n in names - run.errored if run.logits.get(n) != replay.logits.get(n)}
    stopped, slip = run.errored, set(fault.hit)
    if not stopped <= slip or changed - slip:
        return "leaked"
    if any(run.is_read_after_fault(name) for name in stopped):
        return "read late"  # stopped, but only after a forward that read what the slip named
    if changed:
        return "missed"
    return "caught" if stopped else "harmless"
