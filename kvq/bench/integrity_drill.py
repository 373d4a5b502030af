"""The fault drill of `kvq bench integrity`: every fault of `kvq.drill.faults`, each in the
lowest mode that should catch it, against one fault-free run, and its table.

Imports rich and kvq.runtime.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.table import Table

if TYPE_CHECKING:
    from kvq.runtime.engine import Engine


def drill_rows(make_engine: Callable[[str], Engine]) -> list[dict]:
    """One row per fault: caught, who was stopped, whether a stopped request was read after the fault,
    whether everyone else's tokens and fp32 logits match a fault-free run repeating its departures,
    whether every page came back. `make_engine(mode)` gives a fresh engine
    (fp32, so tokens do not depend on the batch; the tests also run `full` on the tags faults)."""
    from kvq.drill.faults import FAULTS
    from kvq.drill.workload import run_drill

    rows = []
    logging.getLogger("kvq.integrity").setLevel(logging.CRITICAL)  # the table reports every stop
    for fault in FAULTS:
        engine = make_engine(fault.mode)
        run = run_drill(engine, fault, catch=True)
        replay = run_drill(make_engine("off"), departures=run.departures, catch=True)
        others = replay.outputs.keys() - set(fault.hit) - set(fault.aborted)
        manager = engine.block_manager
        rows.append(
            {
                "fault": fault.name,
                "mode": fault.mode,
                "caught": run.error is None
                and run.errored == set(fault.hit)
                and run.num_aborts == len(fault.hit),
                "stopped": sorted(run.errored),
                "read_after_fault": any(run.is_read_after_fault(name) for name in fault.hit),
                "others_identical": all(
                    n in run.outputs and run.outputs[n].token_ids == replay.outputs[n].token_ids
                    for n in others
                ),
                "logits_identical": all(run.logits.get(n) == replay.logits.get(n) for n in others),
                "pages_back": manager.num_free_pages == manager.num_pages,
            }
        )
    return rows


def random_fault_rows(make_engine: Callable[[str], Engine], num_faults: int) -> list[dict]:
    """`num_faults` faults the drill was not tuned to (`kvq.drill.random_faults`, seeds 0..n-1), each in
    `tags` against a fault-free run repeating its departures: one row per fault with its outcome."""
    from kvq.drill.random_faults import classify, random_fault
    from kvq.drill.workload import run_drill

    rows = []
    logging.getLogger("kvq.integrity").setLevel(logging.CRITICAL)
    for seed in range(num_faults):
        drawn = random_fault(seed)
        engine = make_engine(drawn.fault.mode)
        run = run_drill(engine, drawn.fault, catch=True)
        replay = run_drill(make_engine("off"), departures=run.departures, catch=True)
        outcome = classify(engine, run, replay, drawn.fault)
        rows.append({"fault": drawn.describe(), "outcome": outcome, "stopped": sorted(run.errored)})
    return rows


def random_fault_table(rows: list[dict]) -> Table:
    """Outcomes of the random faults, counted by kind of slip."""
    table = Table(title=f"{len(rows)} random faults in tags mode (seeds 0-{len(rows) - 1}): outcomes")
    outcomes = ("caught", "harmless", "missed", "leaked", "read late", "crashed", "page leak")
    table.add_column("slip")
    for outcome in outcomes:
        table.add_column(outcome, justify="right")
    kinds = sorted({row["fault"].split(":")[0].split("_", 2)[2] for row in rows})
    for kind in [*kinds, "all"]:
        picked = [r for r in rows if kind == "all" or r["fault"].split(":")[0].split("_", 2)[2] == kind]
        table.add_row(kind, *(str(sum(r["outcome"] == o for r in picked)) for o in outcomes))
    return table


def drill_table(rows: list[dict]) -> Table:
    table = Table(title="fault drill (fp32 engines): each injected fault")
    columns = (
        "fault",
        "mode",
        "caught",
        "stopped",
        "read after fault",
        "others' tokens",
        "logits",
        "pages back",
    )
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["fault"],
            row["mode"],
            "yes" if row["caught"] else "NO",
            ", ".join(row["stopped"]) or "-",
            "YES" if row["read_after_fault"] else "no",
            "same" if row["others_identical"] else "DIFFER",
            "same" if row["logits_identical"] else "differ",
            "yes" if row["pages_back"] else "NO",
        )
    return table
