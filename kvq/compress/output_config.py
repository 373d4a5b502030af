"""The compressed-tensors `quantization_config` of a kvq output, in compressed-tensors' own serialized form.

It is the library's `QuantizationConfig(...).model_dump(mode="json")`, every field filled, written without
importing the library: that import pulls in transformers (~3 s of a compress run, plus ~1 s at exit).
tests/compress/test_output_config.py checks it against the library's own dump.

`group_0` is the recipe's INT4 scheme under target `Linear` (SGLang's W4A16 MoE loader looks it up by
that target) with `format: pack-quantized`. FP8-block tensors kept as FP8 get `group_1`: the FP8_BLOCK
scheme (block weights, dynamic per-group activations, as the FP8 source was served) with
`format: float-quantized`. Its targets are anchored regexes, one per parent module, naming the kept
Linears and the fused layers vLLM and SGLang build from them (`qkv_proj`, `gate_up_proj`,
`fused_qkv_a_proj`): both match a layer's name before a class target, but vLLM tries the `Linear` class
(as a substring of `QKVParallelLinear`) before expanding fused names, so a fused FP8 layer must be named
itself. The checkpoint `format` is then `mixed-precision`. Every other Linear left at source
precision is listed by name in `ignore`, with the recipe's own ignore entries that touch nothing kvq
quantized or kept FP8 (so a tied `lm_head`, which has no tensor of its own, stays unquantized). The MTP
layers' (`model.layers.{N + i}`, past the `num_layers` decoder layers) are listed by one `re:` entry per
parent module that also matches the `model.decoder.` name SGLang's NextN model gives them
(`kvq.checkpoint.mtp_layers`): their experts then resolve like the main layers' in both engines.
"""

from __future__ import annotations

import re
from collections import defaultdict

from kvq.checkpoint.fused_layers import FUSED_LAYERS
from kvq.checkpoint.mtp_layers import mtp_ignore_entries, mtp_layer_of
from kvq.compress.recipe import Recipe, matches_target
from kvq.compress.tensor_plan import CompressPlan

SCHEMA_VERSION = "0.19.0"  # the compressed-tensors release whose `QuantizationConfig` dump this reproduces


def quantization_config(
    recipe: Recipe, plan: CompressPlan, kv_cache_scheme: dict | None = None, num_layers: int | None = None
) -> dict:
    """The `quantization_config` dict for config.json (JSON-ready); a source's KV-cache scheme (from
    `kvq calibrate`, with its `k_scale`/`v_scale` tensors copied through) is kept. `num_layers`: the
    decoder layers (config.json num_hidden_layers); layers past them are MTP layers."""
    groups = {"group_0": _scheme(["Linear"], quantization_args(**recipe.weights_args()), "pack-quantized")}
    if plan.fp8_modules:
        block = list(plan.block)
        groups["group_1"] = _scheme(
            fp8_targets(plan.fp8_modules),
            quantization_args(
                num_bits=8, type="float", strategy="block", block_structure=block, dynamic=False
            ),
            "float-quantized",
            input_activations=quantization_args(
                num_bits=8, type="float", strategy="group", group_size=block[1], dynamic=True
            ),
        )
    return {
        "version": SCHEMA_VERSION,
        "transform_config": {},
        "config_groups": groups,
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": None if kv_cache_scheme is None else quantization_args(**kv_cache_scheme),
        "format": "mixed-precision" if plan.fp8_modules else "pack-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": ignore_list(recipe, plan, num_layers),
    }


def quantization_args(**fields: object) -> dict:
    """`QuantizationArgs(**fields).model_dump(mode="json")` of compressed-tensors: defaults filled."""
    return {**_ARGS_DEFAULTS, "observer_kwargs": {}, **fields}


_ARGS_DEFAULTS: dict[str, object] = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "group_size": None,
    "strategy": None,
    "block_structure": None,
    "dynamic": False,
    "actorder": None,
    "scale_dtype": None,
    "zp_dtype": None,
    "observer": None,
    "observer_kwargs": {},
}


def _scheme(targets: list[str], weights: dict, fmt: str, input_activations: dict | None = None) -> dict:
    return {
        "targets": targets,
        "weights": weights,
        "input_activations": input_activations,
        "output_activations": None,
        "format": fmt,
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


def ignore_list(recipe: Recipe, plan: CompressPlan, num_layers: int | None = None) -> list[str]:
    """Dense Linears by name (MTP layers' by `mtp_ignore_entries`), plus recipe ignore entries that hide
    no INT4 or FP8 module from its group."""
    quantized = [*plan.int4_modules, *plan.fp8_modules]
    safe = [
        entry for entry in recipe.ignore if not any(matches_target(module, entry) for module in quantized)
    ]
    if not plan.has_lm_head:
        safe.append("lm_head")  # tied to the embeddings: nothing stored, nothing to quantize
    dense = set(plan.dense_linear_modules)
    mtp = sorted(m for m in dense if num_layers is not None and mtp_layer_of(m, num_layers) is not None)
    return sorted((dense - set(mtp)) | set(mtp_ignore_entries(mtp)) | set(safe))
