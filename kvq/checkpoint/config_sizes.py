"""The size fields of a language model's config.json that every tensor shape derives from, checked before
anything is built from them: layers, hidden size, vocabulary, attention and KV heads, MLP and expert widths,
MTP layers. A zero, negative, non-integer or contradictory value is a `Mismatch` naming the field, not a
ZeroDivisionError later. Pure functions over the JSON dict; imports kvq.checkpoint.model_config only.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvq.checkpoint.model_config import TextModel

# (field, why it must be a positive integer): always required, then per kind of model.
_ALWAYS = (
    ("num_hidden_layers", "the decoder layers are counted from it"),
    ("hidden_size", "every weight is shaped from it"),
    ("vocab_size", "the embeddings and lm_head are shaped from it"),
    ("num_attention_heads", "attention is split into these heads"),
    ("intermediate_size", "the dense MLP is shaped from it"),
)
_MOE = (("moe_intermediate_size", "the routed experts are shaped from it"),)
_OPTIONAL_POSITIVE = ("num_key_value_heads", "head_dim", "q_lora_rank")
_OPTIONAL_NON_NEGATIVE = ("first_k_dense_replace", "n_shared_experts", "num_nextn_predict_layers")


@dataclass(frozen=True)
class Mismatch:
    """One way a checkpoint contradicts its config.json (or a config field no model can have)."""

    rule: str  # model-type, config, layers, experts, missing, shape, dtype, unexpected
    where: str  # the tensor or config field
    message: str  # what was expected and what was found
    fix: str


def size_mismatches(model: TextModel) -> list[Mismatch]:
    """Every size field of `model` that is missing, not a positive integer, or contradicts another."""
    fields, path = model.fields, model.field_path
    required = list(_ALWAYS) + (list(_MOE) if num_experts(fields) else [])
    out = [
        _bad_field(path, name, fields.get(name), f"{why}, so it must be a positive integer")
        for name, why in required
        if not _is_positive(fields.get(name))
    ]
    for name in _OPTIONAL_POSITIVE:
        value = fields.get(name)
        if value is not None and not _is_positive(value):
            out.append(_bad_field(path, name, value, "when set it must be a positive integer"))
    for name in _OPTIONAL_NON_NEGATIVE:
        value = fields.get(name)
        if value is not None and not _is_count(value):
            out.append(_bad_field(path, name, value, "when set it must be an integer >= 0"))
    if not out and not model.is_mla:
        out += _kv_head_mismatches(fields, path)
    return out


def num_experts(fields: dict) -> int:
    """The routed experts per MoE layer (0 for a dense model or a non-integer value)."""
    value = fields.get("n_routed_experts")
    return int(value) if _is_positive(value) else 0  # type: ignore[arg-type]


def num_mtp_layers(fields: dict) -> int:
    """The MTP / NextN layers the checkpoint may hold after its decoder layers."""
    value = fields.get("num_nextn_predict_layers")
    return int(value) if _is_count(value) else 0  # type: ignore[arg-type]


def _kv_head_mismatches(fields: dict, path: str) -> list[Mismatch]:
    heads = fields["num_attention_heads"]
    kv_heads = fields.get("num_key_value_heads") or heads
    if heads % kv_heads:
        return [
            Mismatch(
                "config",
                f"config.json {path}num_key_value_heads",
                f"is {kv_heads}, which does not divide num_attention_heads {heads} (each KV head serves a "
                "whole group of query heads)",
                "restore the model's original config.json",
            )
        ]
    if "head_dim" not in fields and fields["hidden_size"] % heads:
        return [
            Mismatch(
                "config",
                f"config.json {path}hidden_size",
                f"is {fields['hidden_size']}, not a multiple of num_attention_heads {heads}, and there "
                "is no head_dim",
                "restore the model's original config.json",
            )
        ]
    return []


def _bad_field(path: str, name: str, value: object, why: str) -> Mismatch:
    return Mismatch(
        "config",
        f"config.json {path}{name}",
        f"is {value!r}; {why}",
        "restore the model's original config.json",
    )


def _is_positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
