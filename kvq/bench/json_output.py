"""`--json FILE` of the `kvq bench` commands: the option, and a result written there. Imports typer."""

from __future__ import annotations

import json
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

JsonOption = Annotated[Path | None, typer.Option("--json", help="Where to write the results as JSON.")]


def write_json(result: Any, path: Path | None) -> None:
    """A result (a dataclass or a dict) as indented JSON at `path`; nothing when `path` is None."""
    if path is not None:
        data = asdict(result) if is_dataclass(result) and not isinstance(result, type) else result
        path.write_text(json.dumps(data, indent=2))
