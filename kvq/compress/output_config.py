"""The compressed-tensors `quantization_config` of a kvq output, built with compressed-tensors' own schema.

`group_0` is the recipe's INT4 scheme under target `Linear` (SGLang's W4A16 MoE loader looks it up by
that target) with `format: pack-quantized`. FP8-block tensors kept as FP8 get `group_1`: the FP8_BLOCK
scheme (block weights, dynamic per-group activations, as the FP8 source was served) with
`format: float-quantized`. Its targets are anchored regexes, one per parent module, naming the kept
Linears and the fused layers vLLM and SGLang build from them (`qkv_proj`, `gate_up_proj`,
`fused_qkv_a_proj`): both match a layer's name before a class target, but vLLM tries the `Linear` class
(as a substring of `QKVParallelLinear`) before expanding fused names, so a fused FP8 layer must be named
itself. The checkpoint `format` is then `mixed-precision`. Every other Linear left at source
precision is listed by name in `ignore`, with the recipe's own ignore entries that touch nothing kvq
quantized or kept FP8 (so a tied `lm_head`, which has no tensor of its own, stays unquantized).
"""

from __future__ import annotations

import re
from collections import defaultdict

from kvq.compress.recipe import Recipe, matches_target
from kvq.compress.tensor_plan import CompressPlan


def quantization_config(recipe: Recipe, plan: CompressPlan, kv_cache_scheme: dict | None = None) -> dict:
    """The `quantization_config` dict for config.json (JSON-ready); a source's KV-cache scheme (from
    `kvq calibrate`, with its `k_scale`/`v_scale` tensors copied through) is kept."""
    from compressed_tensors import __version__ as ct_version
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    groups = {
        "group_0": QuantizationScheme(
            targets=["Linear"], weights=QuantizationArgs(**recipe.weights_args()), format="pack-quantized"
        )
    }
    if plan.fp8_modules:
        block = list(plan.block)
        groups["group_1"] = QuantizationScheme(
            targets=fp8_targets(plan.fp8_modules),
            weights=QuantizationArgs(
                num_bits=8,
                type="float",
                strategy="block",
                block_structure=block,
                symmetric=True,
                dynamic=False,
            ),
            input_activations=QuantizationArgs(
                num_bits=8, type="float", strategy="group", group_size=block[1], symmetric=True, dynamic=True
            ),
            format="float-quantized",
        )
    config = QuantizationConfig(
        config_groups=groups,
        ignore=ignore_list(recipe, plan),
        format="mixed-precision" if plan.fp8_modules else "pack-quantized",
        quantization_status="compressed",
        kv_cache_scheme=kv_cache_scheme,
    )
    return {"version": ct_version, "transform_config": {}, **config.model_dump(mode="json")}


# Fused layers of vLLM's / SGLang's llama, glm4_moe and deepseek_v2 (GLM-5) models: `packed_modules_mapping`.
FUSED_LAYERS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}


def fp8_targets(modules: list[str]) -> list[str]:
    """`re:^<parent>\\.(<leaf>|...)$` per parent module: its FP8 Linears and the fused layers made of them."""
    leaves: dict[str, set[str]] = defaultdict(set)
    for module in modules:
        parent, _, leaf = module.rpartition(".")
        leaves[parent].add(leaf)
    targets = []
    for parent, names in sorted(leaves.items()):
        fused = {f for f, shards in FUSED_LAYERS.items() if set(shards) <= names}
        targets.append(f"re:^{re.escape(parent)}\\.({'|'.join(sorted(names | fused))})$")
    return targets


def ignore_list(recipe: Recipe, plan: CompressPlan) -> list[str]:
    """Dense Linears by name, plus recipe ignore entries that hide no INT4 or FP8 module from its group."""
    quantized = [*plan.int4_modules, *plan.fp8_modules]
    safe = [
        entry for entry in recipe.ignore if not any(matches_target(module, entry) for module in quantized)
    ]
    if not plan.has_lm_head:
        safe.append("lm_head")  # tied to the embeddings: nothing stored, nothing to quantize
    return sorted(set(plan.dense_linear_modules) | set(safe))
