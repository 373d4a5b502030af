"""`--config FILE` on the command line: a serving config's settings, overridden by the flags given
(`kvq.commands.field_options.GivenOptions.over`: a flag's default never overrides the file). Imports typer
and kvq.config_file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

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


def read_config(path: Path | None) -> ConfigFile | None:
    return None if path is None else load_config(path)


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
