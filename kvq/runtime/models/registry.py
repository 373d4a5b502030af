"""The language model's model_type -> runtime model class (kimi_k2 is DeepSeek-V3's architecture);
unknown types are an error listing the supported ones."""

from __future__ import annotations

from kvq.checkpoint.model_config import TextModel
from kvq.errors import KvqError
from kvq.runtime.models.deepseek_v3 import DeepseekV3ForCausalLM
from kvq.runtime.models.glm4_moe import Glm4MoeForCausalLM
from kvq.runtime.models.glm_moe_dsa import GlmMoeDsaForCausalLM
from kvq.runtime.models.llama import LlamaForCausalLM

MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "glm_moe_dsa": GlmMoeDsaForCausalLM,
}


def model_class(model: TextModel) -> type[LlamaForCausalLM]:
    """The class that runs `model` (by the transformers architecture that builds it)."""
    if model.architecture not in MODELS:
        raise KvqError(
            f"{model.at}model_type {model.model_type!r} is not supported by the kvq runtime; "
            f"supported: {', '.join(sorted(MODELS))}, kimi_k2"
        )
    return MODELS[model.architecture]
