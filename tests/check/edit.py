"""Copies of tiny checkpoints with an edited config.json: the checkpoints engines refuse, made on purpose."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path


def with_config(src: Path, dst: Path, edit: Callable[[dict], None]) -> Path:
    """`src` copied to `dst` with `edit` applied to its config.json's quantization_config."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def errors(verdict) -> set[str]:
    return {f.rule for f in verdict.findings if f.severity == "error"}
