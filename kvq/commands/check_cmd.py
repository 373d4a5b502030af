"""`kvq check DIR`: will vLLM, SGLang, transformers and the kvq runtime load this checkpoint, and if not,
which rule which tensor breaks. Reads config.json and shard headers only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvq.check import ENGINES, check_checkpoint
from kvq.check.report import CheckReport
from kvq.commands.render import console


def check_command(
    path: Annotated[Path, typer.Argument(help="Checkpoint directory (kvq's output or any other).")],
    engine: Annotated[
        list[str] | None,
        typer.Option(help=f"Engine to check (repeatable): {', '.join(ENGINES)}. Default: all."),
    ] = None,
    tp: Annotated[int, typer.Option(help="Tensor-parallel size the engine will serve on.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print every finding as JSON.")] = False,
) -> None:
    """Say per engine whether it loads PATH at --tp, and which rule (from the engine's own loader code)
    which tensor breaks. Exit code 1 when an engine checked would not load it."""
    report = check_checkpoint(path, engine or ENGINES, tp)
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print_report(report)
    if not all(v.loads for v in report.verdicts):
        raise typer.Exit(1)


def print_report(report: CheckReport) -> None:
    console.print(f"kvq check: {report.path}")
    for line in report.lines():
        console.print(line, markup=False)
