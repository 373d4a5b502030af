"""What `kvq plan` plans over: a checkpoint's stored tensors (headers only), or those a config.json implies.

From a bare config (a public config.json of GLM-5, DeepSeek-V3, Kimi K2.6...), tensor shapes come from the
transformers model of its language model on the meta device (`text_config` for Kimi K2.5 / K2.6, named
with the checkpoint's `language_model.` prefix), plus the MTP layers real checkpoints ship. Its
`quantization_config` lays them out: FP8-block (DeepSeek-V3 rules) for `quant_method: fp8`, the stored
compressed-tensors form (`kvq.compress.compressed_layout`) for an already-compressed release. A vision
tower is not derived from a bare config. Nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvq.checkpoint.header import TensorInfo
from kvq.checkpoint.model_config import TextModel, pretrained_config, text_model
from kvq.checkpoint.reader import CONFIG_NAME, INDEX_NAME, Checkpoint, block_size, read_json
from kvq.checkpoint.validate import validate_checkpoint
from kvq.compress.safetensors_layout import shard_layout
from kvq.compress.tensor_plan import OutputTensor, virtual_tensors
from kvq.errors import KvqError
from kvq.formats.shapes import DEFAULT_BLOCK

COMPRESSED_FORMATS = ("pack-quantized", "float-quantized", "mixed")


@dataclass(frozen=True)
class PlanSource:
    """Tensors to plan over, the config they come with, and whether they exist on disk."""

    path: Path
    config: dict
    model: TextModel
    tensors: dict[str, TensorInfo]
    block: tuple[int, int]
    is_bare_config: bool
    is_compressed: bool  # already compressed-tensors output: nothing left for `kvq compress` to do
    file_bytes: int  # the source shards on disk; for a bare config, as one shard holding every tensor


def open_source(path: str | Path) -> PlanSource:
    """A checkpoint directory, or a config.json (file, or a directory holding only config.json)."""
    path = Path(path)
    config_path = path if path.is_file() else path / CONFIG_NAME
    has_weights = path.is_dir() and ((path / INDEX_NAME).exists() or any(path.glob("*.safetensors")))
    if has_weights:
        ckpt = Checkpoint.open(path)
        model = validate_checkpoint(ckpt)  # what compress validates too: plan and compress accept alike
        file_bytes = sum(header.file_bytes for header in ckpt.shards.values())
        is_compressed = ckpt.format in COMPRESSED_FORMATS
        return PlanSource(
            ckpt.root, ckpt.config, model, ckpt.tensors, block_size(ckpt), False, is_compressed, file_bytes
        )
    config = read_json(config_path, "config.json")
    model = text_model(config, str(config_path))
    tensors, block = config_tensors(model)
    file_bytes = shard_layout([OutputTensor(i.name, i.dtype, i.shape) for i in tensors.values()]).file_bytes
    is_compressed = model.quantization_config.get("quant_method") == "compressed-tensors"
    return PlanSource(config_path, config, model, tensors, block, True, is_compressed, file_bytes)


def config_tensors(model: TextModel) -> tuple[dict[str, TensorInfo], tuple[int, int]]:
    """The tensors a checkpoint of `model` stores (FP8-block if its quantization_config says fp8, the
    compressed-tensors layout if it is compressed), named as in the checkpoint."""
    from kvq.checkpoint.fp8_block_layout import fp8_block_specs
    from kvq.checkpoint.specs import TensorSpec, checkpoint_specs
    from kvq.checkpoint.torch_dtypes import TORCH_TO_SAFETENSORS
    from kvq.compress.compressed_layout import compressed_layout, stored_specs

    specs = checkpoint_specs(pretrained_config(model), include_mtp=True)
    quant = model.quantization_config
    method, block = quant.get("quant_method"), DEFAULT_BLOCK
    if method == "compressed-tensors":
        layout = compressed_layout(quant, model.at)
        specs = [s for spec in specs for s in stored_specs(spec, model.weight_prefix, layout)]
    else:
        if method == "fp8":
            block = tuple(quant.get("weight_block_size", DEFAULT_BLOCK))  # type: ignore[assignment]
            if block != DEFAULT_BLOCK:
                raise KvqError(
                    f"{model.at}quantization_config.weight_block_size {list(block)} is not supported for "
                    f"planning from a bare config (only {list(DEFAULT_BLOCK)}); plan from the checkpoint's "
                    "headers instead"
                )
            specs = [s for spec in specs for s in fp8_block_specs(spec)]
        elif quant:
            raise KvqError(
                f"{model.at}quantization_config quant_method {method!r} is not a layout kvq plans from a "
                "bare config; supported: fp8 (FP8-block), compressed-tensors, or none (BF16)"
            )
        specs = [TensorSpec(model.weight_prefix + s.name, s.shape, s.dtype) for s in specs]
    return virtual_tensors([(s.name, TORCH_TO_SAFETENSORS[s.dtype], s.shape) for s in specs]), block
