"""`kvq inspect DIR`: print what a checkpoint holds, by module kind, from headers only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvq.byte_sizes import format_bytes
from kvq.checkpoint.reader import Checkpoint
from kvq.commands.render import console, human_count
from kvq.inspect import InspectReport, summarize


def render(report: InspectReport) -> Table:
    table = Table(title=f"{report.path}  [bold]{report.format}[/bold]  ({report.num_shards} shards)")
    table.caption = f"model: {report.model}"
    for col in ("module kind", "tensors", "parameters", "dtypes", "bytes"):
        table.add_column(col, justify="left" if col in ("module kind", "dtypes") else "right")
    for kind, row in report.kinds.items():
        table.add_row(
            kind, str(row.tensors), human_count(row.parameters), ",".join(row.dtypes), format_bytes(row.bytes)
        )
    t = report.total
    table.add_row(
        "[bold]total[/bold]",
        str(t.tensors),
        human_count(t.parameters),
        ",".join(t.dtypes),
        f"{format_bytes(t.bytes)} ({t.bytes} B)",
        end_section=True,
    )
    return table


def inspect_command(
    path: Annotated[Path, typer.Argument(help="Checkpoint directory (config.json + *.safetensors).")],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the summary as JSON instead of a table.")
    ] = False,
) -> None:
    """Show a checkpoint's format and, per module kind, tensors, parameters, dtypes, bytes (headers only)."""
    report = summarize(Checkpoint.open(path))
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        console.print(render(report))
