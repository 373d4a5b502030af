"""Serving config files (`configs/*.yaml`): the model, every engine and server option, and for deployments
kvq cannot run here yet (tensor parallelism) what `kvq plan` needs to check they fit their GPUs.

    model: embedded:smollm2          # a checkpoint directory (relative to the file) or an embedded model
    engine: {kv_cache_dtype: fp8_e4m3, max_num_seqs: 64, ...}      # `EngineConfig` fields
    server: {port: 8000, max_waiting: 256, ...}                    # `ServerConfig` fields
    deployment: {tp: 8, gpu_mem: 141GB, mem_fraction: 0.88, ...}   # `Deployment` fields

Read by `kvq serve --config`, `kvq generate --config`, `kvq bench serve --config` and `kvq plan --config`;
flags given on the command line override the file. Unknown keys are errors that list the known ones.
Imports yaml and kvq (no torch: `kvq plan` stays light).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvq.errors import KvqError
from kvq.runtime.config import ENGINE_KEYS  # no torch either

EMBEDDED = {
    "embedded:smollm2": "SmolLM2-135M-Instruct, BF16 (kvq default-model)",
    "embedded:smollm2-int4": "SmolLM2-135M-Instruct, INT4 weights (group 64) + calibrated FP8 KV scales",
}
SECTIONS = ("model", "engine", "server", "deployment")


@dataclass(frozen=True)
class Deployment:
    """A deployment on paper: GPUs and memory that `kvq plan` checks the model against.

    source: what `kvq compress` (or the vendor) started from, for the record (e.g. a Hub repository);
    recipe: the `kvq compress` recipe that makes the served checkpoint from it (None: served as shipped).
    """

    tp: int
    gpu_mem: str
    mem_fraction: float = 1.0
    gpu: str = ""
    source: str = ""
    recipe: str | None = None

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise KvqError(f"deployment.tp must be >= 1, got {self.tp}")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise KvqError(f"deployment.mem_fraction must be in (0, 1], got {self.mem_fraction}")


@dataclass
class ConfigFile:
    path: Path
    model: str | None = None  # as written; `model_dir()` resolves it
    engine: dict[str, Any] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)
    deployment: Deployment | None = None

    def model_dir(self) -> Path | None:
        """The checkpoint directory: an embedded model (built on first use) or a path (relative to the
        file's folder)."""
        if self.model is None:
            return None
        if self.model in EMBEDDED:
            return embedded_model(self.model)
        path = Path(self.model).expanduser()
        return path if path.is_absolute() else (self.path.parent / path).resolve()


def load_config(path: Path) -> ConfigFile:
    """Read and validate a serving config; `KvqError` naming the file and key otherwise."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise KvqError(f"{path}: cannot read the config ({e.strerror}); pass a YAML file") from e
    except yaml.YAMLError as e:
        raise KvqError(f"{path}: not valid YAML ({e})") from e
    if not isinstance(data, dict):
        raise KvqError(
            f"{path}: expected a mapping with keys {', '.join(SECTIONS)}, found {type(data).__name__}"
        )
    _known(path, "", data, SECTIONS)
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise KvqError(f"{path}: model must be a path or one of {', '.join(EMBEDDED)}, found {model!r}")
    from kvq.serve.server_config import ServerConfig  # no torch either

    engine = _section(path, data, "engine", ENGINE_KEYS)
    server = _section(path, data, "server", tuple(f.name for f in dataclasses.fields(ServerConfig)))
    deployment = None
    if "deployment" in data:
        fields = _section(path, data, "deployment", tuple(f.name for f in dataclasses.fields(Deployment)))
        try:
            deployment = Deployment(**fields)
        except TypeError as e:  # a required key missing
            raise KvqError(f"{path}: deployment needs tp and gpu_mem ({e})") from e
        except KvqError as e:
            raise KvqError(f"{path}: {e}") from e
    try:
        ServerConfig(**server)  # validated now, not when the server starts
    except KvqError as e:
        raise KvqError(f"{path}: server.{e}") from e
    return ConfigFile(path, model, engine, server, deployment)


def _section(path: Path, data: dict, name: str, keys: tuple[str, ...]) -> dict[str, Any]:
    section = data.get(name) or {}
    if not isinstance(section, dict):
        raise KvqError(f"{path}: {name} must be a mapping of option: value, found {section!r}")
    _known(path, f"{name}.", section, keys)
    return section


def _known(path: Path, prefix: str, data: dict, keys: tuple[str, ...]) -> None:
    unknown = [k for k in data if k not in keys]
    if unknown:
        raise KvqError(
            f"{path}: unknown key {prefix}{unknown[0]}; the keys {prefix.rstrip('.') or 'at the top'} "
            f"takes are: {', '.join(keys)}"
        )


def embedded_model(name: str) -> Path:
    """The embedded SmolLM2 (BF16), or its INT4 + FP8-KV build (kvq compress + calibrate, made once)."""
    from kvq.data.embedded_model import ensure_smollm2

    bf16 = ensure_smollm2().bf16
    if name == "embedded:smollm2":
        return bf16
    from kvq.smollm2_int4 import ensure_smollm2_int4

    return ensure_smollm2_int4(bf16)
