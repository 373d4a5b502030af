"""Kimi K2.6's native INT4 checkpoint layout for a small DeepSeek-V3 model, and its transformers oracle.

As the release ships it (tests/compress/data/SOURCES.md): config.json `model_type: kimi_k25` with the
language model under `text_config` (`model_type: kimi_k2`) and its compressed-tensors `quantization_config`
there (pack-quantized, symmetric INT4, group 32, `ignore` written with `re:` patterns), so only routed
experts are INT4 (`weight_packed` int32, `weight_scale` bf16, `weight_shape` int32 as in the release);
attention, shared experts, the dense MLP, router, norms, embeddings and lm_head stay BF16. Language-model
tensors carry the `language_model.` prefix beside a few `vision_tower.*` / `mm_projector.*` tensors that a
text-only reader must skip. The oracle (`kimi_oracle_model`) is transformers' DeepseekV3ForCausalLM on the
dequantized weights. Imports torch, transformers and kvq.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from kvq.checkpoint.dense import read_dense
from kvq.checkpoint.model_config import WRAPPERS, load_text_config
from kvq.checkpoint.reader import Checkpoint
from kvq.checkpoint.specs import TensorSpec
from kvq.compress.compressed_layout import compressed_layout, stored_specs
from kvq.formats.pack_quantized import quantize_pack_int4
from kvq.testing.tiny_models import load_tensors

WEIGHT_PREFIX = WRAPPERS["kimi_k25"].weight_prefix
GROUP_SIZE = 32
# Kimi K2.6's quantization_config, verbatim.
QUANTIZATION_CONFIG: dict = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": GROUP_SIZE,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
# A sliver of the vision side (names and layouts of the release's MoonViT tower and projector, tiny).
VISION_SPECS = (
    TensorSpec("vision_tower.patch_embed.proj.weight", (32, 3, 14, 14), torch.bfloat16),
    TensorSpec("vision_tower.encoder.blocks.0.wqkv.weight", (96, 32), torch.bfloat16),
    TensorSpec("vision_tower.encoder.final_layernorm.weight", (32,), torch.bfloat16),
    TensorSpec("mm_projector.proj.0.weight", (128, 128), torch.bfloat16),
)
_TOP_LEVEL = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "ignore_index": -100,
    "tie_word_embeddings": False,
    "use_unified_vision_chunk": True,
    "video_placeholder": "<|kimi_k25_video_placeholder|>",
    "vision_config": {
        "patch_size": 14,
        "vt_hidden_size": 32,
        "vt_num_hidden_layers": 1,
        "mm_hidden_size": 32,
    },
}

Source = Callable[[TensorSpec], torch.Tensor]


def kimi_config_json(config: PretrainedConfig) -> dict:
    """The nested kimi_k25 config.json of a DeepSeek-V3 text model `config`."""
    from kvq.testing.checkpoint_fixtures import config_json

    text = {
        **config_json(config),
        "model_type": "kimi_k2",
        "quantization_config": copy.deepcopy(QUANTIZATION_CONFIG),
    }
    ids = {k: text[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in text}
    return {**copy.deepcopy(_TOP_LEVEL), **ids, "dtype": "bfloat16", "text_config": text}


def kimi_layout(
    specs: Sequence[TensorSpec], source: Source, config: PretrainedConfig
) -> tuple[list[TensorSpec], Callable[[TensorSpec], dict[str, torch.Tensor]], dict]:
    """(The stored tensors, a function making each, the config.json dict) of the BF16 `specs` of `config`
    (a DeepSeek-V3 model) in Kimi's native INT4 layout. `source` gives the BF16 tensor of a spec."""
    from kvq.errors import KvqError

    if config.model_type != "deepseek_v3":
        raise KvqError(f"the kimi-int4 layout holds a deepseek_v3 model, not {config.model_type}")
    layout = compressed_layout(QUANTIZATION_CONFIG, "kimi fixture: ")
    bf16 = {s.name: s for s in specs}
    stored = [s for spec in specs for s in stored_specs(spec, WEIGHT_PREFIX, layout, torch.int32)]
    stored += VISION_SPECS

    def produce(spec: TensorSpec) -> dict[str, torch.Tensor]:
        name = spec.name.removeprefix(WEIGHT_PREFIX)
        if spec in VISION_SPECS:
            return {spec.name: source(spec)}
        module, _, param = name.rpartition(".")
        if param not in ("weight_packed", "weight_scale", "weight_shape"):
            return {spec.name: source(bf16[name])}
        weight = source(bf16[f"{module}.weight"])
        weight_packed, weight_scale = quantize_pack_int4(weight, GROUP_SIZE)
        out = WEIGHT_PREFIX + module
        return {
            f"{out}.weight_packed": weight_packed,
            f"{out}.weight_scale": weight_scale,
            f"{out}.weight_shape": torch.tensor(weight.shape, dtype=torch.int32),
        }

    return stored, produce, kimi_config_json(config)


def kimi_oracle_model(root: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """transformers' DeepseekV3ForCausalLM holding a kimi-int4 checkpoint's language model, experts
    dequantized (exact in fp32: INT4 codes times bf16 scales), in eval mode."""
    config, prefix = load_text_config(root)
    weights = read_dense(Checkpoint.open(root), prefix, dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return load_tensors(model, {name.removeprefix(prefix): tensor for name, tensor in weights.items()})
