"""Hand-made tiny checkpoints for bad-input tests, random ones of an edited tiny config, and a snapshot of a
directory's bytes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from transformers import PretrainedConfig

from kvq.checkpoint.fp8_block_layout import FP8_BLOCK_QUANTIZATION_CONFIG
from kvq.checkpoint.hf_checkpoint import write_checkpoint
from kvq.checkpoint.specs import checkpoint_specs
from kvq.checkpoint.write import save_safetensors_atomic, write_index, write_json_atomic
from kvq.fixtures.tiny_models import random_tensor
from kvq.fixtures.tiny_tokenizer import tiny_tokenizer
from kvq.formats.fp8_block import quantize_fp8_block

EXPERT = "model.layers.1.mlp.experts.0.up_proj"


def fp8_expert(rows: int = 256, cols: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return quantize_fp8_block(torch.randn(rows, cols, generator=gen) * 0.02)


def write_shards(root: Path, shards: dict[str, dict[str, torch.Tensor]], *, fp8: bool = True) -> Path:
    """A checkpoint of the given shard files (name -> tensors), with an index and a minimal config.json."""
    root.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for file_name, tensors in shards.items():
        save_safetensors_atomic(tensors, root / file_name)
        weight_map.update(dict.fromkeys(tensors, file_name))
    total = sum(t.numel() * t.element_size() for tensors in shards.values() for t in tensors.values())
    write_index(root, weight_map, total)
    config = {"model_type": "llama", "torch_dtype": "bfloat16"}
    if fp8:
        config["quantization_config"] = dict(FP8_BLOCK_QUANTIZATION_CONFIG)
    write_json_atomic(config, root / "config.json")
    return root


def random_checkpoint(dst: Path, config: PretrainedConfig, fmt: str, **kwargs) -> Path:
    """The random model (seed 0) of a `tiny_config` `config`, edited or not, as a `fmt` checkpoint in `dst`
    with the fixture tokenizer; `kwargs` go to `write_checkpoint`."""
    return write_checkpoint(
        dst,
        checkpoint_specs(config),
        lambda spec: random_tensor(spec, 0),
        fmt=fmt,
        config=config,
        tokenizer=tiny_tokenizer(),
        **kwargs,
    )


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` (and the file set itself)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(root).rglob("*"))
        if p.is_file()
    }


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
