"""What `kvq plan` plans over: a checkpoint's stored tensors (headers only), or those a config.json implies.

From a bare config (a public config.json of GLM-5, DeepSeek-V3, Kimi-K2...), tensor shapes come from the
transformers model on the meta device, plus the MTP layers real checkpoints ship; a config with an FP8
`quantization_config` is laid out as an FP8-block checkpoint (DeepSeek-V3 rules). Nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvq.checkpoint.header import TensorInfo
from kvq.checkpoint.reader import CONFIG_NAME, INDEX_NAME, Checkpoint, block_size, read_json
from kvq.compress.safetensors_layout import shard_layout
from kvq.compress.tensor_plan import OutputTensor, virtual_tensors
from kvq.errors import KvqError
from kvq.formats.shapes import DEFAULT_BLOCK

# Kimi-K2 ships `model_type: kimi_k2` for a DeepSeek-V3 architecture (its model card says to treat it as one).
_MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


@dataclass(frozen=True)
class PlanSource:
    """Tensors to plan over, the config they come with, and whether they exist on disk."""

    path: Path
    config: dict
    tensors: dict[str, TensorInfo]
    block: tuple[int, int]
    is_bare_config: bool
    file_bytes: int  # the source shards on disk; for a bare config, as one shard holding every tensor


def open_source(path: str | Path) -> PlanSource:
    """A checkpoint directory, or a config.json (file, or a directory holding only config.json)."""
    path = Path(path)
    config_path = path if path.is_file() else path / CONFIG_NAME
    has_weights = path.is_dir() and ((path / INDEX_NAME).exists() or any(path.glob("*.safetensors")))
    if has_weights:
        ckpt = Checkpoint.open(path)
        file_bytes = sum(header.file_bytes for header in ckpt.shards.values())
        return PlanSource(ckpt.root, ckpt.config, ckpt.tensors, block_size(ckpt), False, file_bytes)
    config = read_json(config_path, "config.json")
    tensors, block = config_tensors(config, config_path)
    file_bytes = shard_layout([OutputTensor(i.name, i.dtype, i.shape) for i in tensors.values()]).file_bytes
    return PlanSource(config_path, config, tensors, block, True, file_bytes)


def config_tensors(config: dict, where: Path) -> tuple[dict[str, TensorInfo], tuple[int, int]]:
    """The tensors a checkpoint of `config` stores (FP8-block layout if its quantization_config says fp8)."""
    from transformers import AutoConfig

    from kvq.checkpoint.fp8_block_layout import fp8_block_specs
    from kvq.checkpoint.specs import checkpoint_specs
    from kvq.checkpoint.torch_dtypes import TORCH_TO_SAFETENSORS

    fields = {
        k: v
        for k, v in config.items()
        if k not in ("transformers_version", "auto_map", "quantization_config")
    }
    model_type = str(fields.get("model_type", ""))
    model_type = _MODEL_TYPE_ALIASES.get(model_type, model_type)
    try:
        hf_config = AutoConfig.for_model(model_type, **{k: v for k, v in fields.items() if k != "model_type"})
    except (ValueError, KeyError, TypeError) as e:
        raise KvqError(
            f"{where}: cannot build model_type {fields.get('model_type')!r} from this config ({e}); "
            "kvq plans llama, glm4_moe, glm_moe_dsa and deepseek_v3 / kimi_k2 configs"
        ) from e
    specs = checkpoint_specs(hf_config, include_mtp=True)
    quant = config.get("quantization_config") or {}
    block = DEFAULT_BLOCK
    if quant:
        if quant.get("quant_method") != "fp8":
            raise KvqError(
                f"{where}: quantization_config quant_method {quant.get('quant_method')!r} is not a "
                "source kvq compresses; plan from a BF16 or FP8-block model's config"
            )
        block = tuple(quant.get("weight_block_size", DEFAULT_BLOCK))
        if block != DEFAULT_BLOCK:
            raise KvqError(
                f"{where}: weight_block_size {list(block)} is not supported for planning from a bare "
                f"config (only {list(DEFAULT_BLOCK)}); plan from the checkpoint's headers instead"
            )
        specs = [s for spec in specs for s in fp8_block_specs(spec)]
    return virtual_tensors([(s.name, TORCH_TO_SAFETENSORS[s.dtype], s.shape) for s in specs]), block
