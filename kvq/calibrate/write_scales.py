"""Add calibrated KV scales to a checkpoint in place: extra shard, index, config.json, manifest.

`prepare_update` checks everything and builds every JSON document before anything is written; `apply_update`
then writes `kv_scales.safetensors`, the index (created if the checkpoint had a single
`model.safetensors` and no index), config.json and `kvq_manifest.json` as one unit
(`kvq.checkpoint.file_commit`: staged, then renamed in that order, the manifest last; a failure or a
kill leaves the checkpoint as it was). Re-calibrating replaces the previous `kv_scales.safetensors` and
its index entries. Imports kvq.checkpoint, compressed_tensors (schema validation) and torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from compressed_tensors.quantization import QuantizationConfig
from pydantic import ValidationError

from kvq.calibrate.scales_record import (
    FILE_KEY,
    MANIFEST_KEY,
    MANIFEST_NAME,
    SCALES_FILE,
    UNIT_FILES,
    file_record,
)
from kvq.checkpoint.file_commit import commit_files
from kvq.checkpoint.model_config import with_quantization_config
from kvq.checkpoint.reader import CONFIG_NAME, Checkpoint, read_json
from kvq.checkpoint.write import index_document, write_bytes_atomic, write_json_atomic
from kvq.errors import KvqError

__all__ = ["MANIFEST_KEY", "SCALES_FILE", "apply_update", "prepare_update"]
_SCALE_SUFFIXES = (".k_scale", ".v_scale")


@dataclass(frozen=True)
class CheckpointUpdate:
    """Everything one calibration writes, ready to go to disk."""

    weight_map: dict[str, str]  # the new index: tensor -> shard
    total_size: int
    config: dict
    manifest: dict


def kv_cache_scheme(strategy: str) -> dict:
    """The compressed-tensors QuantizationArgs of an FP8 e4m3 KV cache with static scales."""
    return {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}


def quantization_config_with_kv(existing: dict, strategy: str, where: str) -> dict:
    """`existing` quantization_config plus `kv_cache_scheme`; a new kv-only compressed-tensors one if empty.

    compressed-tensors configs (kvq compress, llm-compressor) get the key and are validated against
    compressed-tensors' schema; an FP8-block `quant_method: fp8` config keeps its method (vLLM's and
    SGLang's Fp8Config load `k_scale`/`v_scale` through Fp8KVCacheMethod and ignore unknown keys).
    """
    scheme = kv_cache_scheme(strategy)
    method = existing.get("quant_method")
    if not existing:
        updated = {
            "quant_method": "compressed-tensors",
            "format": "dense",
            "quantization_status": "compressed",
            "config_groups": {},
            "ignore": [],
            "kv_cache_scheme": scheme,
        }
    elif method in ("compressed-tensors", "fp8"):
        updated = {**existing, "kv_cache_scheme": scheme}
    else:
        raise KvqError(
            f"{where}: quantization_config has quant_method {method!r}; kvq calibrate can add KV "
            "scales to BF16, FP8-block (fp8) and compressed-tensors checkpoints only"
        )
    if updated["quant_method"] == "compressed-tensors":
        try:
            QuantizationConfig.model_validate(updated)
        except ValidationError as e:
            raise KvqError(
                f"{where}: quantization_config is not a valid compressed-tensors config once "
                f"kv_cache_scheme is added ({e.errors()[0]['msg']}); fix config.json"
            ) from e
    return updated


def prepare_update(
    ckpt: Checkpoint, scales: dict[str, torch.Tensor], strategy: str, record: dict
) -> CheckpointUpdate:
    """Check that `scales` can be added to `ckpt` and build the new index, config and manifest."""
    foreign = sorted(
        n for n, info in ckpt.tensors.items() if n.endswith(_SCALE_SUFFIXES) and info.file.name != SCALES_FILE
    )
    if foreign:
        raise KvqError(
            f"{ckpt.root}: already stores KV scales in its weight shards ({foreign[0]} in "
            f"{ckpt.tensors[foreign[0]].file.name}); kvq replaces only scales it wrote to "
            f"{SCALES_FILE}: remove those tensors (or start from the source checkpoint)"
        )
    kept = {n: info for n, info in ckpt.tensors.items() if info.file.name != SCALES_FILE}
    weight_map = {n: info.file.relative_to(ckpt.root).as_posix() for n, info in kept.items()}
    weight_map |= {name: SCALES_FILE for name in scales}
    total_size = sum(info.nbytes for info in kept.values()) + sum(t.nbytes for t in scales.values())
    config = with_quantization_config(
        ckpt.config,
        quantization_config_with_kv(ckpt.quantization_config, strategy, str(ckpt.root / CONFIG_NAME)),
    )
    manifest_path = ckpt.root / MANIFEST_NAME
    manifest = read_json(manifest_path, "kvq manifest") if manifest_path.exists() else {}
    manifest[MANIFEST_KEY] = record
    return CheckpointUpdate(weight_map, total_size, config, manifest)


def apply_update(ckpt: Checkpoint, scales: dict[str, torch.Tensor], update: CheckpointUpdate) -> None:
    """Write the scales shard, the index, config.json and the manifest as one unit, the manifest last."""
    from safetensors.torch import save

    # One metadata key ("format"): safetensors writes several in a random order (a Rust HashMap), which made
    # two writes of the same scales differ in bytes. Who wrote the file is in the manifest.
    data = save({k: v.contiguous() for k, v in scales.items()}, metadata={"format": "pt"})
    manifest = {**update.manifest, FILE_KEY: file_record(data)}
    index = index_document(update.weight_map, update.total_size)
    writers = (
        lambda path: write_bytes_atomic(data, path),
        lambda path: write_json_atomic(index, path),
        lambda path: write_json_atomic(update.config, path),
        lambda path: write_json_atomic(manifest, path),
    )
    commit_files(ckpt.root, list(zip(UNIT_FILES, writers, strict=True)))
