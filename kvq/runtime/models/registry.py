"""config.json `model_type` -> runtime model class; unknown types are an error listing the supported ones."""

from __future__ import annotations

from kvq.errors import KvqError
from kvq.runtime.models.glm4_moe import Glm4MoeForCausalLM
from kvq.runtime.models.llama import LlamaForCausalLM

MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
}


def model_class(config: dict, where: str) -> type[LlamaForCausalLM]:
    """The class for a config.json dict; `where` names the file in the error message."""
    model_type = config.get("model_type")
    if model_type not in MODELS:
        raise KvqError(
            f"{where}: architecture (model_type) {model_type!r} is not supported by the kvq "
            f"runtime; supported: {', '.join(sorted(MODELS))}"
        )
    return MODELS[model_type]
