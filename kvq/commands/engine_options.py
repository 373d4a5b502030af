"""The runtime engine's command-line options, declared once by `EngineConfig`'s fields and taken (all or
some) by `kvq generate`, `serve`, `eval` and `bench decode`; the MODEL argument of those commands."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated

import typer

from kvq.commands.field_options import F, field_options
from kvq.runtime.config import ENGINE_OPTIONS, EngineConfig

OptionalModelArgument = Annotated[
    Path | None,
    typer.Argument(
        help="Checkpoint directory (BF16, FP8-block or compressed-tensors); default: --config's model."
    ),
]


def engine_options(*names: str, help: Mapping[str, str] | None = None) -> Callable[[F], F]:
    """Decorate a command: the engine options `names` (default: all) replace its parameter `engine`, which
    receives them as `GivenOptions`; `help` rewords an option for this command."""
    return field_options(EngineConfig, "engine", names or ENGINE_OPTIONS, help)
