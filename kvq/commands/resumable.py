"""Ctrl-C in a command whose manifest records finished work (`kvq compress`, with GPTQ too): one line that
says where and how to resume, and exit status 130. Imports typer and kvq.commands.render."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from kvq.commands.render import console


@contextmanager
def resumable(finished: str, manifest: Path) -> Iterator[None]:
    """Run the body; on Ctrl-C print that the `finished` work (e.g. "shards") is recorded in `manifest`."""
    try:
        yield
    except KeyboardInterrupt:
        console.print(
            f"interrupted: finished {finished} are recorded in {manifest}; re-run the same command to resume"
        )
        raise typer.Exit(130) from None
