"""Classify a tensor name into the module kind that the plan, inspect and recipes reason about."""

from __future__ import annotations

import re
from functools import lru_cache

MODULE_KINDS = (
    "attention",
    "dense_mlp",
    "routed_experts",
    "shared_experts",
    "router",
    "embeddings",
    "norms",
    "kv_scales",
    "vision",
    "other",
)

_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    # beside a multimodal wrapper's language model (Kimi K2.5 / K2.6: vision_tower.*, mm_projector.*)
    ("vision", re.compile(r"^(vision_tower|mm_projector)\.")),
    ("kv_scales", re.compile(r"\.(k_scale|v_scale|q_scale|kv_scale)$")),
    ("embeddings", re.compile(r"(^|\.)(embed_tokens|lm_head|wte|shared_head\.head)\.")),
    ("norms", re.compile(r"(^|\.)[a-z_]*norm[a-z_]*\.(weight|bias)$")),
    ("router", re.compile(r"\.mlp\.gate\.(weight|e_score_correction_bias)$|\.router\.")),
    ("routed_experts", re.compile(r"\.mlp\.experts\.")),
    ("shared_experts", re.compile(r"\.mlp\.shared_experts?\.")),
    ("attention", re.compile(r"\.(self_attn|attention)\.")),
    ("dense_mlp", re.compile(r"\.mlp\.(gate_proj|up_proj|down_proj)\.")),
)


_INDEX = re.compile(r"\.\d+\.")


def module_kind(name: str) -> str:
    """The module kind of a tensor name: `model.layers.3.mlp.experts.7.up_proj.weight` -> routed_experts."""
    return _template_kind(_INDEX.sub(".0.", name))  # no rule reads an index: one answer per template


@lru_cache(maxsize=65536)
def _template_kind(name: str) -> str:
    for kind, pattern in _RULES:
        if pattern.search(name):
            return kind
    return "other"
