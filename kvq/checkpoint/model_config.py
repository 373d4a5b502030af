"""The language model a config.json describes: where its fields live, which transformers architecture builds
it, the tensor-name prefix of its weights, and the MLA / MoE / RoPE fields kvq implements (others refused).

Every command reads config.json through here. A multimodal wrapper keeps the language model under
`text_config` (Kimi K2.5 / K2.6: `model_type: kimi_k25`, `text_config.model_type: kimi_k2`, the DeepSeek-V3
architecture) and stores its tensors under a prefix. Pure functions over the JSON dict; only
`pretrained_config` imports transformers. Imports kvq.errors (and kvq.checkpoint.reader for file reading).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvq.errors import KvqError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# config.json model_type -> the transformers 5.17 model_type that builds it. Kimi K2.x ship `kimi_k2`, which
# transformers does not know as a text model: it is the DeepSeek-V3 architecture (the Kimi-K2 model card,
# and transformers' own Kimi_K25Config maps `kimi_k2` to `deepseek_v3`).
ARCHITECTURES = {
    "llama": "llama",
    "glm4_moe": "glm4_moe",
    "glm_moe_dsa": "glm_moe_dsa",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
}
MLA_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "glm_moe_dsa")


@dataclass(frozen=True)
class Wrapper:
    """A multimodal config whose language model is nested: the key holding it, the model types allowed
    there, and the prefix its tensors carry in the checkpoint."""

    text_key: str
    text_model_types: tuple[str, ...]
    weight_prefix: str


# Kimi K2.5 / K2.6 safetensors: `language_model.model.layers.*`, `language_model.model.embed_tokens.weight`,
# `language_model.lm_head.weight` beside `vision_tower.*` and `mm_projector.*` (vLLM
# vllm/model_executor/models/kimi_k25.py `_KEYS_TO_MODIFY_MAPPING`; transformers 5.17 conversion_mapping.py
# "kimi_k25" renames `language_model.model` / `language_model.lm_head`; the published Kimi-K2.5 weight
# listing: 208,550 tensors of which 335 are vision_tower / mm_projector).
WRAPPERS = {"kimi_k25": Wrapper("text_config", ("kimi_k2", "deepseek_v3"), "language_model.")}

# What kvq's runtime (and transformers' deepseek_v3 / glm4_moe / glm_moe_dsa routers, its oracle) compute:
# DeepSeek-V3's aux-loss-free top-k (sigmoid scores, `e_score_correction_bias` for the choice, `n_group` /
# `topk_group` group limit, `routed_scaling_factor`). DeepSeek-V2's `greedy` / `group_limited_greedy`
# softmax routers are another algorithm: refused, not approximated.
TOPK_METHODS = ("noaux_tc",)
SCORING_FUNCS = ("sigmoid",)
# RoPE types whose frequencies are a fixed table (what the runtime precomputes). MLA models: DeepSeek's
# YaRN (its mscale also rescales the softmax) or none. `dynamic` / `longrope` change with sequence length.
ROPE_TYPES_MLA = ("default", "yarn")
ROPE_TYPES_GQA = ("default", "linear", "llama3", "yarn")
_MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
_DSA_FIELDS = ("index_topk", "index_head_dim", "index_n_heads")
_NOT_MODEL_FIELDS = ("model_type", "transformers_version", "auto_map", "quantization_config", "_name_or_path")


@dataclass(frozen=True)
class TextModel:
    """The language model of a config.json, validated."""

    fields: dict  # its config.json fields (the wrapper's `text_config` for a nested model)
    model_type: str  # as the config names it: kimi_k2, deepseek_v3, glm_moe_dsa, glm4_moe, llama
    architecture: str  # the transformers model_type that builds it (deepseek_v3 for kimi_k2)
    weight_prefix: str  # prepended to transformers' state-dict names in the checkpoint ("" unless nested)
    wrapper: str | None  # the top-level model_type of a nested model (kimi_k25), else None
    quantization_config: dict  # the checkpoint's, wherever config.json keeps it; {} if none
    where: str  # the config.json path, for messages

    @property
    def is_mla(self) -> bool:
        return self.model_type in MLA_MODEL_TYPES

    @property
    def field_path(self) -> str:
        """How messages name this model's fields inside config.json: '' or 'text_config.'."""
        return f"{WRAPPERS[self.wrapper].text_key}." if self.wrapper else ""

    @property
    def at(self) -> str:
        """The prefix of a message about one of its fields: 'path/config.json: text_config.'."""
        return f"{self.where}: {self.field_path}"

    def checkpoint_name(self, hf_name: str) -> str:
        """The checkpoint's tensor name of a transformers state-dict name (`model.layers.0...`)."""
        return self.weight_prefix + hf_name

    def hf_name(self, checkpoint_name: str) -> str | None:
        """The transformers state-dict name of a checkpoint tensor; None for tensors outside the language
        model (a vision tower, a multimodal projector)."""
        if not checkpoint_name.startswith(self.weight_prefix):
            return None
        return checkpoint_name[len(self.weight_prefix) :]


def supported_model_types() -> str:
    """For messages: every model_type kvq reads, and the wrappers."""
    wrapped = [
        f"{name} (with {w.text_key}.model_type {' or '.join(w.text_model_types)})"
        for name, w in WRAPPERS.items()
    ]
    return ", ".join([*ARCHITECTURES, *wrapped])


def read_text_model(path: str | Path) -> TextModel:
    """The language model of a checkpoint directory's config.json, or of a config.json file."""
    from kvq.checkpoint.reader import CONFIG_NAME, read_json

    path = Path(path)
    config_path = path if path.is_file() else path / CONFIG_NAME
    return text_model(read_json(config_path, "config.json"), str(config_path))


def text_model(config: dict, where: str) -> TextModel:
    """Resolve and validate the language model of a config.json dict; `where` names the file in errors.

    Raises `KvqError` naming the field for an unknown model_type or an MLA / MoE / RoPE setting kvq does
    not implement, with what is supported.
    """
    model_type = config.get("model_type")
    wrapper = WRAPPERS.get(model_type) if isinstance(model_type, str) else None
    if wrapper is None:
        arch = _check_model_type(model_type, where, "model_type", tuple(ARCHITECTURES))
        model = TextModel(config, arch, ARCHITECTURES[arch], "", None, _quant(config), where)
    else:
        fields = config.get(wrapper.text_key)
        if not isinstance(fields, dict):
            raise KvqError(
                f"{where}: model_type {model_type!r} keeps its language model under {wrapper.text_key!r}, "
                f"but config.json has no {wrapper.text_key} object; restore the model's original config.json"
            )
        inner = _check_model_type(
            fields.get("model_type"), where, f"{wrapper.text_key}.model_type", wrapper.text_model_types
        )
        quant = _nested_quant(config, fields, wrapper, where)
        model = TextModel(
            fields, inner, ARCHITECTURES[inner], wrapper.weight_prefix, str(model_type), quant, where
        )
    _check_fields(model)
    return model


def quantization_config_of(config: dict) -> dict:
    """A config.json's `quantization_config`, top level or (Kimi K2.5 / K2.6) inside `text_config`; {} if
    none. No validation: header-only readers use it on any config."""
    if config.get("quantization_config"):
        return config["quantization_config"]
    wrapper = WRAPPERS.get(config.get("model_type"))  # type: ignore[arg-type]
    nested = config.get(wrapper.text_key) if wrapper else None
    return (nested.get("quantization_config") or {}) if isinstance(nested, dict) else {}


def weight_prefix_of(config: dict) -> str:
    """The tensor-name prefix of a config.json's language model ("" unless nested). No validation:
    `kvq compress` works on tensor names of any architecture."""
    wrapper = WRAPPERS.get(config.get("model_type"))  # type: ignore[arg-type]
    return wrapper.weight_prefix if wrapper else ""


def with_quantization_config(config: dict, quant: dict) -> dict:
    """A copy of config.json with `quant` as its quantization_config, where the checkpoint keeps it: inside
    `text_config` for a Kimi K2.5 / K2.6 wrapper (as the release does; vLLM and compressed-tensors look
    there after the top level), else at the top level."""
    out = dict(config)
    wrapper = WRAPPERS.get(config.get("model_type"))  # type: ignore[arg-type]
    if wrapper is None or not isinstance(config.get(wrapper.text_key), dict):
        out["quantization_config"] = quant
        return out
    out.pop("quantization_config", None)
    out[wrapper.text_key] = {**config[wrapper.text_key], "quantization_config": quant}
    return out


def pretrained_config(model: TextModel) -> PretrainedConfig:
    """The transformers config of the language model (DeepseekV3Config for kimi_k2), without its
    quantization_config: kvq's readers hand transformers dense weights."""
    from huggingface_hub.errors import StrictDataclassError  # transformers 5 configs' own validators
    from transformers import AutoConfig

    fields = {k: v for k, v in model.fields.items() if k not in _NOT_MODEL_FIELDS}
    try:
        return AutoConfig.for_model(model.architecture, **fields)
    except (ValueError, KeyError, TypeError, StrictDataclassError) as e:
        raise KvqError(
            f"{model.where}: transformers cannot build a {model.architecture} config from "
            f"{model.field_path or 'the top level'} fields ({' '.join(str(e).split())}); fix the field it "
            "names"
        ) from e


def load_text_config(model_dir: str | Path) -> tuple[PretrainedConfig, str]:
    """(The transformers config of a checkpoint's language model, the prefix of its tensor names)."""
    model = read_text_model(model_dir)
    return pretrained_config(model), model.weight_prefix


def _check_model_type(model_type: object, where: str, field: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(model_type, str) or model_type not in allowed:
        found = "no model_type" if model_type is None else f"{field} {model_type!r}"
        raise KvqError(
            f"{where}: {found}: kvq does not implement this architecture; supported: "
            f"{', '.join(allowed) if field.endswith('.model_type') else supported_model_types()}"
        )
    return model_type


def _quant(config: dict) -> dict:
    return config.get("quantization_config") or {}


def _nested_quant(config: dict, fields: dict, wrapper: Wrapper, where: str) -> dict:
    top, nested = _quant(config), _quant(fields)
    if top and nested and top != nested:
        raise KvqError(
            f"{where}: quantization_config and {wrapper.text_key}.quantization_config differ; a checkpoint "
            "has one quantization: keep the one its tensors were written with and remove the other"
        )
    return top or nested


def _check_fields(model: TextModel) -> None:
    """The MLA, MoE and RoPE settings of `model` are ones kvq implements."""
    fields, at = model.fields, model.at
    if model.is_mla:
        for name in _MLA_FIELDS:
            positive_int(fields, name, at, f"{model.model_type} is an MLA model")
        if model.model_type == "glm_moe_dsa":
            for name in _DSA_FIELDS:
                positive_int(fields, name, at, "glm_moe_dsa has a DSA indexer")
    if fields.get("n_routed_experts") not in (None, 0):
        positive_int(fields, "n_routed_experts", at, "it counts the routed experts of each MoE layer")
        _check_router(fields, at)
    _check_rope(fields, at, ROPE_TYPES_MLA if model.is_mla else ROPE_TYPES_GQA)


def positive_int(fields: dict, name: str, at: str, why: str) -> int:
    """`fields[name]` if it is a positive integer; else `KvqError` "{at}{name} is ...; {why}, so ..."."""
    value = fields.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KvqError(f"{at}{name} is {value!r}; {why}, so it must be a positive integer")
    return value


def _check_router(fields: dict, at: str) -> None:
    for name, allowed in (("topk_method", TOPK_METHODS), ("scoring_func", SCORING_FUNCS)):
        value = fields.get(name, allowed[0])
        if value not in allowed:
            raise KvqError(
                f"{at}{name} {value!r} is not implemented; kvq routes as DeepSeek-V3 does "
                f"({name}: {', '.join(allowed)}): supported {name}: {', '.join(allowed)}"
            )
    if fields.get("moe_layer_freq", 1) != 1:
        raise KvqError(
            f"{at}moe_layer_freq {fields['moe_layer_freq']!r} is not implemented; kvq (as transformers) "
            "makes every layer after first_k_dense_replace an MoE layer: supported moe_layer_freq: 1"
        )
    num_experts = int(fields["n_routed_experts"])
    n_group, topk_group = fields.get("n_group") or 1, fields.get("topk_group") or 1
    top_k = fields.get("num_experts_per_tok")
    top_k = top_k if isinstance(top_k, int) and not isinstance(top_k, bool) else 0  # refused below
    if not (isinstance(n_group, int) and isinstance(topk_group, int) and 1 <= topk_group <= n_group):
        raise KvqError(
            f"{at}n_group {n_group!r} / topk_group {topk_group!r}: need 1 <= topk_group <= n_group"
        )
    if num_experts % n_group or (n_group > 1 and num_experts // n_group < 2):
        raise KvqError(
            f"{at}n_routed_experts {num_experts} in n_group {n_group} groups: each group must hold the same "
            "number of experts, at least 2 when there are several groups (a group scores its top 2)"
        )
    if not 1 <= top_k <= topk_group * (num_experts // n_group):
        raise KvqError(
            f"{at}num_experts_per_tok {fields.get('num_experts_per_tok')!r}: need 1 to "
            f"{topk_group * (num_experts // n_group)} (topk_group {topk_group} groups of "
            f"{num_experts // n_group} experts)"
        )


def rope_type(params: object) -> str:
    """The RoPE type of a `rope_parameters` (transformers 5) or `rope_scaling` (the checkpoints' own
    configs, DeepSeek-V3 and Kimi: `type: yarn`) value; "default" when it does not scale."""
    if not params:
        return "default"
    if not isinstance(params, dict):
        return repr(params)
    return str(params.get("rope_type") or params.get("type") or "default")


def _check_rope(fields: dict, at: str, allowed: tuple[str, ...]) -> None:
    """Both keys, when a config carries both (transformers reads either)."""
    for key in ("rope_parameters", "rope_scaling"):
        params, kind = fields.get(key), rope_type(fields.get(key))
        if kind not in allowed:
            raise KvqError(
                f"{at}{key} type {kind!r} is not implemented for this architecture; supported RoPE "
                f"types: {', '.join(allowed)}"
            )
        factor = params.get("factor") if isinstance(params, dict) else None
        if kind == "yarn" and (
            isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0
        ):
            raise KvqError(
                f"{at}{key}.factor is {factor!r}; YaRN needs its scaling factor, a positive number"
            )
