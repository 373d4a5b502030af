"""The `--recipe` and `--group-size` options that `kvq plan` and `kvq compress` share (one help text)."""

from __future__ import annotations

from typing import Annotated

import typer

RecipeOption = Annotated[
    str,
    typer.Option(
        "--recipe", help="Built-in recipe (w4a16-experts, w4a16-linear: kvq/recipes/) or a YAML path."
    ),
]
GroupSizeOption = Annotated[
    int | None, typer.Option("--group-size", help="Override the recipe's group size (32, 64 or 128).")
]
