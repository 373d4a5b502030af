"""A checkpoint's compressed-tensors `quantization_config` as vLLM and SGLang read it: targets -> schemes,
the name matching both engines apply (they share vLLM's code, with small differences noted per function),
and the scheme class each engine builds for a scheme. Plain dicts: no compressed-tensors import.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvq.checkpoint.fused_layers import FUSED_LAYERS

PACK_QUANTIZED = "pack-quantized"
# compressed_tensors/utils.py is_activation_quantization_format (vLLM adds nvfp4-pack-quantized)
ACTIVATION_FORMATS = ("naive-quantized", "int-quantized", "float-quantized")
WNA16, W8A8_FP8, W8A16_FP8 = "CompressedTensorsWNA16", "CompressedTensorsW8A8Fp8", "CompressedTensorsW8A16Fp8"
FUSED_MAPPING = {fused: list(parts) for fused, parts in FUSED_LAYERS.items()}


@dataclass(frozen=True)
class Scheme:
    """One config group's scheme as the engines hold it under each of its targets."""

    group: str
    weights: dict
    input_activations: dict | None
    format: str | None  # the group's own `format` (None: the top-level one applies)

    @property
    def group_size(self) -> int:
        size = self.weights.get("group_size")
        return -1 if size is None else int(size)


def scheme_map(quant: Mapping) -> dict[str, Scheme]:
    """target -> scheme, in config order (a later group's target replaces an earlier one), as
    `CompressedTensorsConfig._quantization_scheme_map_from_config` builds it."""
    out: dict[str, Scheme] = {}
    for group, body in (quant.get("config_groups") or {}).items():
        for target in body.get("targets") or []:
            out[target] = Scheme(
                group, body.get("weights") or {}, body.get("input_activations"), body.get("format")
            )
    return out


def is_equal_or_regex_match(value: str, target: str, check_contains: bool = False) -> bool:
    """vllm/model_executor/layers/quantization/utils/config_utils.py `is_equal_or_regex_match` (SGLang's
    compressed_tensors/utils.py `_is_equal_or_regex_match` is the same): `re:` is `re.match`, otherwise
    equality, or a case-insensitive substring test when `check_contains`."""
    if target.startswith("re:"):
        return re.match(target[3:], value) is not None
    if check_contains:
        return target.lower() in value.lower()
    return target == value


def first_match(value: str, targets: Iterable[str], check_contains: bool = False) -> str | None:
    return next((t for t in targets if is_equal_or_regex_match(value, t, check_contains)), None)


def match_fused_layer(layer_name: str, targets: Iterable[str]) -> str | None:
    """`_match_fused_layer` (both engines): a fused layer matches when every part matches some target;
    the first part's target is returned (parts matching other targets are not compared)."""
    fused = next((f for f in FUSED_MAPPING if layer_name.endswith(f)), None)
    if fused is None:
        return None
    targets = list(targets)
    matches = [first_match(layer_name.replace(fused, part), targets) for part in FUSED_MAPPING[fused]]
    return matches[0] if all(matches) else None


def shard_names(layer_name: str) -> list[str]:
    parent, _, leaf = layer_name.rpartition(".")
    return [f"{parent}.{part}" for part in FUSED_MAPPING[leaf]] if leaf in FUSED_MAPPING else [layer_name]


def scheme_class(scheme: Scheme | None, top_format: str | None, *, per_group_format: bool) -> str | None:
    """The `CompressedTensorsScheme` class `_get_scheme_from_parts` returns, None for unquantized, or
    "" where it raises `NotImplementedError` ("No compressed-tensors compatible scheme was found").

    `per_group_format`: vLLM reads a group's own `format` before the top-level one (vLLM PR #22468);
    SGLang main reads only the top-level `format`, and keeps `input_activations` only when that format is
    an activation format (`_quantization_scheme_map_from_config`)."""
    if scheme is None:
        return None
    fmt = (scheme.format or top_format) if per_group_format else top_format
    weights = scheme.weights
    inputs = scheme.input_activations
    if not per_group_format and fmt not in ACTIVATION_FORMATS:
        inputs = None
    is_static = not weights.get("dynamic", False)
    if (
        weights.get("type", "int") == "int"
        and weights.get("strategy") in ("group", "channel")
        and is_static
        and inputs is None
        and fmt == PACK_QUANTIZED
        and weights.get("num_bits") in (4, 8)
    ):
        return WNA16
    if fmt in ACTIVATION_FORMATS and weights.get("type") == "float" and weights.get("num_bits") == 8:
        is_fp8_weight = weights.get("symmetric", True) and is_static
        if is_fp8_weight and weights.get("strategy") in ("tensor", "channel", "block"):
            if inputs is None:
                return W8A16_FP8
            if inputs.get("type") == "float" and (
                inputs.get("dynamic") or inputs.get("strategy") == "tensor"
            ):
                return W8A8_FP8
    return ""
