"""Open a checkpoint directory: config.json, the shard index and every shard header, validated up front.

Nothing here reads tensor data until `read`/`read_many` is called; those go through the index, so a
tensor (a `weight_scale_inv`, say) is found wherever it is stored. Opening imports no torch (`kvq plan`
and the `kvq compress` parent only read headers).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvq.checkpoint.dtypes import FLOAT_CODES, FP8_CODES
from kvq.checkpoint.header import ShardHeader, TensorInfo, read_header
from kvq.checkpoint.model_config import quantization_config_of
from kvq.errors import KvqError
from kvq.formats.shapes import DEFAULT_BLOCK

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"


def read_json(path: Path, what: str) -> dict:
    """Load a JSON object from `path`, raising `KvqError` that names the file on any problem."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise KvqError(f"{path}: no {what} found; is this a Hugging Face model directory?") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KvqError(f"{path}: {what} is not valid JSON ({e}); fix or re-download it") from e
    if not isinstance(data, dict):
        raise KvqError(f"{path}: {what} must be a JSON object, found {type(data).__name__}")
    return data


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint directory. `tensors` maps every stored tensor name to where it lives."""

    root: Path
    config: dict
    shards: dict[str, ShardHeader]  # shard file name (relative to root) -> header
    tensors: dict[str, TensorInfo]

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        root = Path(path)
        if not root.exists():
            raise KvqError(f"{root}: no such directory; pass the path of a model checkpoint directory")
        if not root.is_dir():
            raise KvqError(
                f"{root}: not a directory; pass the directory holding config.json and *.safetensors"
            )
        config = read_json(root / CONFIG_NAME, "config.json")
        shard_names, weight_map = _shard_layout(root)
        shards = {name: read_header(root / name) for name in shard_names}
        tensors: dict[str, TensorInfo] = {}
        for name, header in shards.items():
            for tensor_name, info in header.tensors.items():
                if tensor_name in tensors:
                    raise KvqError(
                        f"{root}: tensor {tensor_name!r} is stored twice "
                        f"({tensors[tensor_name].file.name} and {name}); remove one copy"
                    )
                tensors[tensor_name] = info
        for tensor_name, shard in weight_map.items():
            found = tensors.get(tensor_name)
            if found is None or found.file.name != os.path.basename(shard):
                raise KvqError(
                    f"{root / INDEX_NAME}: names tensor {tensor_name!r} in {shard}, "
                    f"but {shard} does not contain it; the index does not match the shards"
                )
        return cls(root, config, shards, tensors)

    @property
    def quantization_config(self) -> dict:
        """The checkpoint's quantization_config: top level, or inside `text_config` (Kimi K2.5 / K2.6)."""
        return quantization_config_of(self.config)

    @property
    def format(self) -> str:
        return detect_format(self.tensors.values())

    @property
    def tensor_bytes(self) -> int:
        return sum(info.nbytes for info in self.tensors.values())

    def under(self, prefix: str) -> Checkpoint:
        """The tensors named `prefix...`, known without the prefix: a multimodal checkpoint's language model
        (`language_model.model.layers.0...` -> `model.layers.0...`, the transformers names) with its vision
        tower left out. Reads still use the stored names (`TensorInfo.name`)."""
        if not prefix:
            return self
        tensors = {n.removeprefix(prefix): i for n, i in self.tensors.items() if n.startswith(prefix)}
        return dataclasses.replace(self, tensors=tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KvqError(f"{self.root}: tensor {name!r} is not in this checkpoint") from None

    def read(self, name: str) -> torch.Tensor:
        return self.read_many([name])[name]

    def read_many(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Read tensors by name, opening each shard once; returns CPU tensors owning their memory."""
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name in names:
            by_file[self.info(name).file].append(name)
        from safetensors import safe_open

        out: dict[str, torch.Tensor] = {}
        for file, file_names in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in file_names:
                    out[name] = f.get_tensor(self.tensors[name].name)  # the stored name (see `under`)
        return out


def _shard_layout(root: Path) -> tuple[list[str], dict[str, str]]:
    """The shard files of a checkpoint and its index weight map (empty for a single-file checkpoint)."""
    index_path = root / INDEX_NAME
    if index_path.exists():
        index = read_json(index_path, "safetensors index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise KvqError(f"{index_path}: has no 'weight_map'; re-create the index or remove it")
        shard_names = sorted(set(weight_map.values()))
        for shard in shard_names:
            if not (root / shard).is_file():
                raise KvqError(
                    f"{index_path}: names shard {shard}, which is missing from {root}; "
                    f"download or restore {shard}"
                )
        return shard_names, weight_map
    shard_names = sorted(p.name for p in root.glob("*.safetensors"))
    if not shard_names:
        raise KvqError(f"{root}: no *.safetensors files and no {INDEX_NAME}; not a safetensors checkpoint")
    return shard_names, {}


def detect_format(tensors: Iterable[TensorInfo]) -> str:
    """bf16/fp16/fp32 (dense), fp8-block, pack-quantized, float-quantized or mixed, from names and dtypes."""
    suffixes: set[str] = set()
    float_codes: dict[str, int] = defaultdict(int)
    has_fp8 = False
    for info in tensors:
        suffixes.add(info.name.rsplit(".", 1)[-1])
        has_fp8 |= info.dtype in FP8_CODES
        if info.dtype in FLOAT_CODES:
            float_codes[info.dtype] += info.numel
    if "weight_packed" in suffixes:
        return "mixed" if has_fp8 else "pack-quantized"
    if "weight_scale_inv" in suffixes:
        return "fp8-block"
    if has_fp8:
        return "float-quantized"
    if not float_codes:
        return "unknown"
    return {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}[
        max(float_codes, key=lambda code: float_codes[code])
    ]


def block_size(ckpt: Checkpoint) -> tuple[int, int]:
    """The FP8 block shape declared in config.json (`weight_block_size` or a block `block_structure`)."""
    qc = ckpt.quantization_config
    if "weight_block_size" in qc:
        return tuple(qc["weight_block_size"])  # type: ignore[return-value]
    for group in (qc.get("config_groups") or {}).values():
        structure = (group.get("weights") or {}).get("block_structure")
        if structure:
            return tuple(structure)  # type: ignore[return-value]
    return DEFAULT_BLOCK
