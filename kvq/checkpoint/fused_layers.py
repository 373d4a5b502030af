"""The fused layers vLLM and SGLang build from stored Linears (`packed_modules_mapping` of their llama,
glm4_moe and deepseek_v2 / GLM-5 models): one GEMM over the parts, stacked by output rows, in this order."""

from __future__ import annotations

FUSED_LAYERS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}


def fused_layer(module: str, present: set[str] | frozenset[str]) -> tuple[str, tuple[str, ...]]:
    """(the engine layer's name, its stored parts in order) for stored Linear `module`: the fused layer
    when all its parts are in `present`, else `module` alone."""
    parent, _, leaf = module.rpartition(".")
    for fused, parts in FUSED_LAYERS.items():
        if leaf in parts:
            names = tuple(f"{parent}.{p}" for p in parts)
            if all(n in present for n in names):
                return f"{parent}.{fused}", names
    return module, (module,)
