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
    whether everyone else's tokens match the fault-free run. `make_engine(mode)` gives a fresh engine
    (fp32, so tokens do not depend on the batch; the tests also run `full` on the tags faults)."""
    from kvq.drill.faults import FAULTS
    from kvq.drill.workload import run_drill

    clean = run_drill(make_engine("off"))
    rows = []
    logging.getLogger("kvq.integrity").setLevel(logging.CRITICAL)  # the table reports every stop
    for fault in FAULTS:
        run = run_drill(make_engine(fault.mode), fault)
        others = clean.outputs.keys() - set(fault.hit)
        is_same = all(run.outputs[n].token_ids == clean.outputs[n].token_ids for n in others)
        rows.append(
            {
                "fault": fault.name,
                "mode": fault.mode,
                "caught": run.errored == set(fault.hit) and run.num_aborts == len(fault.hit),
                "stopped": sorted(run.errored),
                "read_after_fault": any(run.is_read_after_fault(name) for name in fault.hit),
                "others_identical": is_same,
            }
        )
    return rows


def drill_table(rows: list[dict]) -> Table:
    table = Table(title="fault drill (fp32 engines): each injected fault")
    for column in ("fault", "mode", "caught", "stopped", "read after fault", "others identical"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["fault"],
            row["mode"],
            "yes" if row["caught"] else "NO",
            ", ".join(row["stopped"]) or "-",
            "YES" if row["read_after_fault"] else "no",
            "yes" if row["others_identical"] else "NO",
        )
    return table
