"""Every tensor a language model needs against what its checkpoint stores (transformers names, headers only):
missing, mis-shaped, in a dtype nothing reads, or stored but not part of the model.

A Linear's weight may be stored as the source has it (`weight`: BF16/FP16/FP32, or FP8 with its
`weight_scale_inv` / `weight_scale`) or as compressed-tensors `pack-quantized` (`weight_packed` int32
`[out, in * bits / 32]` + `weight_scale` `[out, in / group]`). Integer codes under `.weight` (an int8
Linear with no scales) are no format kvq or an engine reads. Imports kvq.checkpoint (specs: transformers).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from kvq.checkpoint.config_sizes import Mismatch
from kvq.checkpoint.dtypes import FLOAT_CODES, FP8_CODES
from kvq.checkpoint.header import TensorInfo
from kvq.checkpoint.model_config import TextModel, pretrained_config
from kvq.checkpoint.module_kind import module_kind
from kvq.errors import KvqError

# Stored beside a Linear's weight by the formats kvq reads (FP8 block, compressed-tensors).
LINEAR_PARTNERS = (
    "weight_scale_inv",
    "weight_scale",
    "weight_packed",
    "weight_shape",
    "weight_zero_point",
    "weight_g_idx",
    "input_scale",
)
# Attention-side scales (calibrated FP8 KV cache) and the rotary buffer older checkpoints saved.
_ALLOWED_EXTRA = re.compile(r"\.self_attn\.(attn\.)?(k|v|q|kv|prob)_scale$|\.rotary_emb\.inv_freq$")
_FIX_SHAPE = "the checkpoint and its config.json describe different models: restore the config.json it was "
_FIX_SHAPE += "written with, or the shards"
_FIX_DTYPE = (
    "convert from the original BF16 / FP8-block release (kvq reads float Linears or FP8 e4m3 with block "
    "scales, or compressed-tensors pack-quantized)"
)
_PACK_FACTORS = (8, 4)  # int32 words hold 8 4-bit or 4 8-bit values


def tensor_mismatches(
    model: TextModel, tensors: Mapping[str, TensorInfo], *, has_mtp: bool
) -> list[Mismatch]:
    """Missing, mis-shaped, unreadable and unexpected tensors of `model` in `tensors` (transformers names)."""
    try:
        specs = _expected_shapes(model, has_mtp)
    except KvqError as e:
        return [Mismatch("config", "config.json", str(e), "fix the field it names")]
    is_tied = bool(model.fields.get("tie_word_embeddings"))
    out: list[Mismatch] = []
    claimed: set[str] = set()
    for name, shape in specs.items():
        if name == "lm_head.weight" and is_tied and name not in tensors:
            continue
        out += _one_tensor(model.weight_prefix, name, shape, tensors, claimed)
    for name in sorted(set(tensors) - claimed):
        if not _ALLOWED_EXTRA.search(name):
            out.append(
                Mismatch(
                    "unexpected",
                    model.weight_prefix + name,
                    f"{list(tensors[name].shape)} is stored but is no tensor of a {model.model_type} model",
                    "remove it, or restore the config.json the checkpoint was written with",
                )
            )
    return out


def _expected_shapes(model: TextModel, has_mtp: bool) -> dict[str, tuple[int, ...]]:
    from kvq.checkpoint.specs import checkpoint_specs

    config = pretrained_config(model)
    try:
        specs = checkpoint_specs(config, include_mtp=has_mtp)
    except (ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError, RuntimeError) as e:
        raise KvqError(
            f"transformers cannot build a {model.architecture} model from its fields "
            f"({type(e).__name__}: {e})"
        ) from e
    return {s.name: s.shape for s in specs}


def _one_tensor(
    prefix: str,
    name: str,
    shape: tuple[int, ...],
    tensors: Mapping[str, TensorInfo],
    claimed: set[str],
) -> list[Mismatch]:
    module = name.removesuffix(".weight")
    is_linear = len(shape) == 2 and name.endswith(".weight") and _is_linear(name)
    if is_linear:
        claimed.update(f"{module}.{p}" for p in LINEAR_PARTNERS if f"{module}.{p}" in tensors)
    info = tensors.get(name)
    if info is None and is_linear and f"{module}.weight_packed" in tensors:
        return _packed(prefix, module, shape, tensors)
    if info is None:
        return [
            Mismatch(
                "missing",
                prefix + name,
                f"{list(shape)} is absent",
                "the checkpoint is incomplete: restore the missing shards (check the index)",
            )
        ]
    claimed.add(name)
    if tuple(info.shape) != shape:
        return [
            Mismatch(
                "shape",
                prefix + name,
                f"has shape {list(info.shape)}, config.json implies {list(shape)}",
                _FIX_SHAPE,
            )
        ]
    return _dtype_mismatches(prefix, name, info, tensors, is_linear=is_linear)


def _dtype_mismatches(
    prefix: str, name: str, info: TensorInfo, tensors: Mapping[str, TensorInfo], *, is_linear: bool
) -> list[Mismatch]:
    """A float tensor, or a Linear weight in FP8 beside its scale: anything else no reader takes."""
    allowed = FLOAT_CODES | FP8_CODES if is_linear else FLOAT_CODES
    if info.dtype not in allowed:
        return [
            Mismatch(
                "dtype",
                prefix + name,
                f"is {info.dtype}; expected {' / '.join(sorted(allowed))}",
                _FIX_DTYPE,
            )
        ]
    module = name.removesuffix(".weight")
    scales = (f"{module}.weight_scale_inv", f"{module}.weight_scale")
    if info.dtype in FP8_CODES and not any(scale in tensors for scale in scales):
        return [
            Mismatch(
                "missing",
                f"{prefix}{module}.weight_scale_inv",
                f"is absent: FP8 weight {prefix}{name} has no scale",
                "restore the shard holding its weight_scale_inv",
            )
        ]
    return []


def _is_linear(name: str) -> bool:
    return module_kind(name) not in ("embeddings", "router", "norms")


def _packed(
    prefix: str, module: str, shape: tuple[int, ...], tensors: Mapping[str, TensorInfo]
) -> list[Mismatch]:
    """compressed-tensors pack-quantized: int32 words of 4- or 8-bit values, a scale per group of inputs."""
    rows, cols = shape
    packed, scale = tensors[f"{module}.weight_packed"], tensors.get(f"{module}.weight_scale")
    fits_packed = (
        packed.dtype == "I32"
        and len(packed.shape) == 2
        and packed.shape[0] == rows
        and any(packed.shape[1] * f == cols for f in _PACK_FACTORS)
    )
    fits_scale = (
        scale is not None
        and len(scale.shape) == 2
        and scale.shape[0] == rows
        and 0 < scale.shape[1] <= cols
        and cols % scale.shape[1] == 0
    )
    if fits_packed and fits_scale:
        return []
    found = f"weight_packed {packed.dtype}{list(packed.shape)}, weight_scale " + (
        f"{list(scale.shape)}" if scale is not None else "absent"
    )
    return [
        Mismatch(
            "shape",
            f"{prefix}{module}.weight_packed",
            f"({found}) does not store a [{rows}, {cols}] weight as config.json implies",
            _FIX_SHAPE,
        )
    ]
