"""Write a whole checkpoint directory laid out like real Hugging Face ones: BF16, FP8-block (DeepSeek-V3
style) or a layout the caller passes (the fixtures' Kimi K2.6 native INT4: `kvq.fixtures.kimi_fixture`),
from a transformers config, a tokenizer and a function giving each BF16 tensor.

`write_checkpoint` is what the embedded model (`kvq.data.embedded_model`) and the random fixtures
(`kvq.fixtures`) share: >= 3 shards through kvq's atomic writer, an index, a cross-shard
`weight_scale_inv`, config.json (+ FP8 `quantization_config`), generation_config.json and tokenizer files.
Tensors are produced shard by shard from a `source` callable, so a 1-2 GB benchmark checkpoint never sits
in memory whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from kvq.checkpoint.fp8_block_layout import FP8_BLOCK_QUANTIZATION_CONFIG, fp8_block_specs
from kvq.checkpoint.sharding import shard_file_names, spec_nbytes, split_shards
from kvq.checkpoint.specs import TensorSpec
from kvq.checkpoint.staging import staged_dir
from kvq.checkpoint.write import save_safetensors_atomic, write_index, write_json_atomic
from kvq.errors import KvqError
from kvq.formats.fp8_block import quantize_fp8_block

FORMATS = ("bf16", "fp8-block")
DEFAULT_MAX_SHARD_BYTES = 512 * 1024**2

Source = Callable[[TensorSpec], torch.Tensor]  # the BF16 checkpoint's tensor for a spec
Produce = Callable[[TensorSpec], dict[str, torch.Tensor]]  # a stored tensor, with any partner made with it
# (BF16 specs, source, config) -> (the stored specs, a function making each, the config.json dict)
Layout = Callable[[Sequence[TensorSpec], Source, PretrainedConfig], tuple[list[TensorSpec], Produce, dict]]


def write_checkpoint(
    out_dir: Path,
    specs: Sequence[TensorSpec],
    source: Source,
    *,
    fmt: str | Layout,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    generation_config: GenerationConfig | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write `specs` (the BF16 tensors, in module order) as a `fmt` checkpoint directory, atomically: `fmt`
    one of `FORMATS`, or a `Layout` of the caller's."""
    if isinstance(fmt, str) and fmt not in FORMATS:
        raise KvqError(f"checkpoint format {fmt!r} is unknown; pick one of {', '.join(FORMATS)}")
    bf16_specs = {s.name: s for s in specs}
    generation_config = generation_config or GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    if not isinstance(fmt, str):
        stored, produce, config_dict = fmt(specs, source, config)
    else:
        stored = [s for spec in specs for s in fp8_block_specs(spec)] if fmt == "fp8-block" else list(specs)
        config_dict = config_json(config)
        if fmt == "fp8-block":
            config_dict["quantization_config"] = dict(FP8_BLOCK_QUANTIZATION_CONFIG)

        def produce(spec: TensorSpec) -> dict[str, torch.Tensor]:
            return _materialize(spec, bf16_specs, source)

    return write_stored(out_dir, stored, produce, config_dict, tokenizer, generation_config, max_shard_bytes)


def write_stored(
    out_dir: Path,
    stored: Sequence[TensorSpec],
    produce: Produce,
    config_dict: dict,
    tokenizer: PreTrainedTokenizerBase,
    generation_config: GenerationConfig,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write the `stored` tensors (made by `produce`) and the model files as a checkpoint, atomically."""
    shards = split_shards(stored, max_shard_bytes)
    out_dir = Path(out_dir)
    with staged_dir(out_dir) as tmp:
        weight_map = _write_shards(tmp, shards, produce)
        write_index(tmp, weight_map, total_size=sum(spec_nbytes(s) for s in stored))
        write_json_atomic(config_dict, tmp / "config.json")
        write_json_atomic(generation_config.to_diff_dict(), tmp / "generation_config.json")
        save_tokenizer(tokenizer, tmp)
    return out_dir


def config_json(config: PretrainedConfig) -> dict:
    """`config.to_dict()` less the generic fields left at their defaults (`id2label`, `return_dict`, ...).

    Model fields are all kept, defaults included, so readers other than transformers need no defaults.
    """
    generic = PretrainedConfig().to_dict()
    generic.pop("transformers_version")
    return {k: v for k, v in config.to_dict().items() if k not in generic or v != generic[k]}


def _write_shards(root: Path, shards: list[list[TensorSpec]], produce: Produce) -> dict[str, str]:
    """Materialize and write each shard in turn; tensors made together (an FP8 weight and its scale) are
    made once, even when a shard boundary splits them."""
    pending: dict[str, torch.Tensor] = {}  # stored name -> tensor made early with its FP8 partner
    weight_map: dict[str, str] = {}
    for file_name, shard in zip(shard_file_names(len(shards)), shards, strict=True):
        tensors: dict[str, torch.Tensor] = {}
        for spec in shard:
            if spec.name not in pending:
                pending.update(produce(spec))
            tensor = pending.pop(spec.name)
            assert tensor.dtype == spec.dtype and tuple(tensor.shape) == spec.shape, (spec, tensor.shape)
            tensors[spec.name] = tensor
            weight_map[spec.name] = file_name
        save_safetensors_atomic(tensors, root / file_name)
    assert not pending, sorted(pending)
    return weight_map


def _materialize(
    stored: TensorSpec, bf16_specs: dict[str, TensorSpec], source: Source
) -> dict[str, torch.Tensor]:
    """The stored tensor(s) behind `stored`: a BF16 tensor, or an FP8 weight together with its scale."""
    if stored.dtype != torch.float8_e4m3fn and not stored.name.endswith(".weight_scale_inv"):
        return {stored.name: source(bf16_specs[stored.name])}
    weight_name = stored.name.removesuffix("_scale_inv")
    weight, weight_scale_inv = quantize_fp8_block(source(bf16_specs[weight_name]))
    return {weight_name: weight, f"{weight_name}_scale_inv": weight_scale_inv}


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, root: Path) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja, readable by transformers 4.x and 5.x."""
    tokenizer.save_pretrained(str(root))
    path = root / "tokenizer_config.json"
    tokenizer_config = json.loads(path.read_text())
    # transformers 5 writes its own class name; older readers (a vLLM venv) know the classic one.
    if tokenizer_config.get("tokenizer_class") == "TokenizersBackend":
        tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
        tokenizer_config.pop("backend", None)
    for loading_kwarg in ("is_local", "local_files_only"):  # transformers 5 saves how it was loaded
        tokenizer_config.pop(loading_kwarg, None)
    if tokenizer.chat_template and "chat_template" not in tokenizer_config:
        tokenizer_config["chat_template"] = tokenizer.chat_template
    write_json_atomic(tokenizer_config, path)
