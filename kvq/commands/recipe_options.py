"""The `--recipe`, `--group-size` and `--target` options of `kvq plan` and `kvq compress` (one help text)."""

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
TargetOption = Annotated[
    str,
    typer.Option(
        "--target",
        help="Serving engine layout: vllm (INT4 + FP8-block kept, format mixed-precision) or sglang (INT4 "
        "under `Linear`, format pack-quantized, FP8 weights not quantized written as BF16). Both load in "
        "transformers and kvq; `kvq check` says which engine loads what.",
    ),
]
