"""`--config FILE` on the command line: a serving config's settings, overridden by the flags given.

A flag counts as given when it came from the command line or its environment variable (click's
parameter source), so a flag's default never overrides the file. Imports typer/click and kvq.config_file.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import typer

from kvq.config_file import ConfigFile, load_config
from kvq.errors import KvqError

ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="A serving config (YAML, see configs/): model, engine and server options; flags given here "
        "override it.",
    ),
]
_GIVEN = ("COMMANDLINE", "ENVIRONMENT")  # click's ParameterSource names (typer ships its own click)


def read_config(path: Path | None) -> ConfigFile | None:
    return None if path is None else load_config(path)


def settings(ctx: typer.Context, from_file: dict[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """The file's settings with the flags among `names` that were given on top."""
    given = {n: ctx.params[n] for n in names if getattr(ctx.get_parameter_source(n), "name", None) in _GIVEN}
    return {**from_file, **given}


def model_dir(model: Path | None, config: ConfigFile | None) -> Path:
    """MODEL if given, else the config's model; `KvqError` when neither names one."""
    if model is not None:
        return model
    found = None if config is None else config.model_dir()
    if found is None:
        raise KvqError("no model: pass MODEL (a checkpoint directory) or a --config whose file sets model")
    return found


def refuse_paper_deployment(config: ConfigFile | None, command: str) -> None:
    """A config for several GPUs describes a deployment to plan (`kvq plan --config`), not one to start."""
    if config is not None and config.deployment is not None and config.deployment.tp > 1:
        raise KvqError(
            f"{config.path}: a deployment on {config.deployment.tp} GPUs (tensor parallel), which "
            f"kvq {command} --config does not start; on the machine that has them run `kvq {command} "
            f"MODEL --tp {config.deployment.tp}` (kvq starts the ranks, or torchrun does; NCCL on CUDA "
            f"has not run on a GPU yet). `kvq plan --config {config.path}` checks that it fits"
        )
