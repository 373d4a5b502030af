"""The `--recipe`, `--group-size` and `--target` options of `kvq plan` and `kvq compress` (one help text),
and the warning both print for a recipe that matches no Linear."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from kvq.compress.recipe import Recipe
    from kvq.compress.tensor_plan import CompressPlan

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


def warn_if_unmatched(plan: CompressPlan, recipe: Recipe) -> None:
    """A recipe whose targets match no Linear of the source quantizes nothing: say so, by name, on stderr
    (the output would be the source re-encoded)."""
    if plan.int4_modules or plan.kept:
        return
    linears = sorted({*plan.fp8_modules, *plan.dense_linear_modules})
    example = f" (e.g. {next((m for m in linears if '.layers.' in m), linears[0])})" if linears else ""
    typer.echo(
        f"kvq: warning: recipe {recipe.name!r} ({recipe.path}) quantizes nothing: its targets "
        f"{list(recipe.targets)} less its ignore list match none of the source's {len(linears)} Linears"
        f"{example}; pick another --recipe or fix its targets",
        err=True,
    )
