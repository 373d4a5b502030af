"""Every tensor a Hugging Face checkpoint of a transformers architecture stores, derived from its config.

The shapes come from the model built on the meta device (no memory), with transformers' fused 3-D
experts split back into the per-expert 2-D tensors real checkpoints hold. Optionally the multi-token-
prediction (MTP / NextN) layers, which transformers does not build but DeepSeek-V3, GLM-4.5 and GLM-5
checkpoints ship, are added. Used by the fixtures and by `kvq plan` on a bare config.json.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from kvq.checkpoint.expert_layout import split_expert_shapes


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as stored on disk: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


# Whether an MTP layer stores its own `embed_tokens` and `shared_head.head` (vocab x hidden) copies:
# DeepSeek-V3/R1 and GLM-4.5 indexes list both under the MTP layer; GLM-5.x shares the main ones.
_MTP_OWN_EMBEDDINGS = {"deepseek_v3": True, "kimi_k2": True, "glm4_moe": True, "glm_moe_dsa": False}


def meta_model(config: PretrainedConfig) -> PreTrainedModel:
    """The causal-LM model of `config` on the meta device (shapes only, no memory)."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def checkpoint_specs(config: PretrainedConfig, *, include_mtp: bool = False) -> list[TensorSpec]:
    """Every tensor of the model as a real HF checkpoint stores it (per-expert 2-D), in module order.

    Dtypes are the BF16 checkpoint's: bf16 everywhere except the fp32 router `e_score_correction_bias`.
    With `include_mtp`, `num_nextn_predict_layers` MTP layers follow the decoder layers, each a copy of the
    last decoder layer's tensors plus `enorm`, `hnorm`, `eh_proj` `[H, 2H]` and `shared_head.norm`.
    """
    specs: list[TensorSpec] = []
    for name, tensor in meta_model(config).state_dict().items():
        for disk_name, shape in split_expert_shapes(name, tuple(tensor.shape)):
            dtype = torch.float32 if disk_name.endswith("e_score_correction_bias") else torch.bfloat16
            specs.append(TensorSpec(disk_name, shape, dtype))
    num_mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0) if include_mtp else 0
    return specs + [s for i in range(num_mtp) for s in _mtp_layer_specs(config, specs, i)]


def _mtp_layer_specs(config: PretrainedConfig, specs: list[TensorSpec], i: int) -> list[TensorSpec]:
    num_layers, hidden = config.num_hidden_layers, config.hidden_size
    last, layer = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers + i}."
    out = [
        TensorSpec(layer + s.name.removeprefix(last), s.shape, s.dtype)
        for s in specs
        if s.name.startswith(last)
    ]
    bf16 = torch.bfloat16
    out += [
        TensorSpec(layer + "enorm.weight", (hidden,), bf16),
        TensorSpec(layer + "hnorm.weight", (hidden,), bf16),
        TensorSpec(layer + "eh_proj.weight", (hidden, 2 * hidden), bf16),
        TensorSpec(layer + "shared_head.norm.weight", (hidden,), bf16),
    ]
    if _MTP_OWN_EMBEDDINGS.get(config.model_type, True):
        vocab = (config.vocab_size, hidden)
        out += [
            TensorSpec(layer + "embed_tokens.weight", vocab, bf16),
            TensorSpec(layer + "shared_head.head.weight", vocab, bf16),
        ]
    return out
