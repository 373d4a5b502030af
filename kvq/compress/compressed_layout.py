"""Which tensors a compressed-tensors checkpoint stores, from its `quantization_config` and names alone.

For `kvq plan` on the bare config.json of an already-compressed release (Kimi K2.6's native INT4) and for
fixtures written in such a layout. Matching is compressed-tensors': a group's `targets` and the `ignore`
list hold `Linear`, exact module names or `re:` patterns (re.match); a name or pattern match beats the
`Linear` class target. Names are tried with and without the checkpoint's language-model prefix: vLLM
matches the unprefixed name after its own renaming, so Kimi's `ignore: [lm_head]` covers
`language_model.lm_head`. A Linear is a 2-D `.weight` that is not a norm, a token embedding or an MoE
router (`mlp.gate`, a bare parameter in DeepSeek-V3 / Kimi / GLM, never a quantization target).
Supported groups: symmetric INT4 `pack-quantized` with group strategy, and 8-bit float `float-quantized`
with block strategy (kvq's own mixed output). Imports torch (tensor specs) and kvq.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvq.checkpoint.module_kind import module_kind
from kvq.checkpoint.specs import TensorSpec
from kvq.compress.recipe import matches_target
from kvq.compress.tensor_plan import is_linear_weight
from kvq.errors import KvqError
from kvq.formats.shapes import PACK_FACTOR, scale_inv_shape

PACK_QUANTIZED, FLOAT_QUANTIZED = "pack-quantized", "float-quantized"


@dataclass(frozen=True)
class WeightScheme:
    """One config group: what its Linear weights are stored as."""

    targets: tuple[str, ...]
    format: str  # pack-quantized (INT4 groups) or float-quantized (FP8 blocks)
    group_size: int = 0  # pack-quantized
    block: tuple[int, int] = (0, 0)  # float-quantized


@dataclass(frozen=True)
class CompressedLayout:
    schemes: tuple[WeightScheme, ...]
    ignore: tuple[str, ...]

    def scheme_for(self, names: tuple[str, ...]) -> WeightScheme | None:
        """The scheme of the Linear module known by `names` (prefixed, unprefixed); None if not quantized."""
        if any(matches_target(n, i) for n in names for i in self.ignore):
            return None
        named = [
            s
            for s in self.schemes
            if any(t != "Linear" and matches_target(n, t) for n in names for t in s.targets)
        ]
        by_class = [s for s in self.schemes if "Linear" in s.targets]
        return next(iter(named or by_class), None)


def compressed_layout(quant: dict, at: str) -> CompressedLayout:
    """Validate a compressed-tensors `quantization_config`; `at` starts error messages."""
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise KvqError(f"{at}quantization_config has no config_groups: not a compressed-tensors checkpoint")
    schemes = tuple(
        _scheme(group, quant, f"{at}quantization_config.config_groups.{key}") for key, group in groups.items()
    )
    ignore = quant.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise KvqError(f"{at}quantization_config.ignore must be a list of module names or re: patterns")
    return CompressedLayout(schemes, tuple(ignore))


def _scheme(group: object, quant: dict, at: str) -> WeightScheme:
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
        raise KvqError(f"{at}: expected an object with targets and weights")
    weights, fmt = group["weights"], group.get("format") or quant.get("format")
    targets = tuple(group.get("targets") or ())
    found = {k: weights.get(k) for k in ("num_bits", "type", "symmetric", "strategy")}
    if fmt == PACK_QUANTIZED and found == {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
    }:
        return WeightScheme(targets, fmt, group_size=int(weights["group_size"]))
    if fmt == FLOAT_QUANTIZED and found == {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": "block",
    }:
        return WeightScheme(targets, fmt, block=tuple(weights["block_structure"]))  # type: ignore[arg-type]
    raise KvqError(
        f"{at}: format {fmt!r} with weights {found} is not a layout kvq reads; supported: pack-quantized "
        "(num_bits 4, type int, symmetric, strategy group) and float-quantized (num_bits 8, type float, "
        "symmetric, strategy block)"
    )


def is_quantizable_linear(name: str, shape: tuple[int, ...]) -> bool:
    """A Linear `.weight` a compressed-tensors `Linear` target can reach (the MoE router is not one)."""
    return is_linear_weight(name, shape) and module_kind(name) != "router"


def stored_specs(
    spec: TensorSpec, prefix: str, layout: CompressedLayout, shape_dtype: torch.dtype = torch.int64
) -> list[TensorSpec]:
    """The checkpoint tensors of one BF16 tensor `spec` (a transformers name): itself under `prefix`, or
    its compressed form. `shape_dtype`: `weight_shape`'s dtype (int64 in compressed-tensors 0.19; the
    Kimi K2.5 / K2.6 release stores int32)."""
    name = prefix + spec.name
    scheme = None
    if is_quantizable_linear(spec.name, spec.shape):
        scheme = layout.scheme_for((name.removesuffix(".weight"), spec.name.removesuffix(".weight")))
    if scheme is None:
        return [TensorSpec(name, spec.shape, spec.dtype)]
    module, (rows, cols) = name.removesuffix(".weight"), spec.shape
    if scheme.format == FLOAT_QUANTIZED:
        return [
            TensorSpec(name, spec.shape, torch.float8_e4m3fn),
            TensorSpec(f"{module}.weight_scale", scale_inv_shape(spec.shape, scheme.block), torch.float32),
        ]
    if cols % scheme.group_size:
        return [TensorSpec(name, spec.shape, spec.dtype)]  # kept at source precision, as kvq compress does
    return [
        TensorSpec(f"{module}.weight_packed", (rows, cols // PACK_FACTOR), torch.int32),
        TensorSpec(f"{module}.weight_scale", (rows, cols // scheme.group_size), spec.dtype),
        TensorSpec(f"{module}.weight_shape", (2,), shape_dtype),
    ]
