"""Which tensors a DeepSeek-V3 / GLM-4.5-FP8 / GLM-5-FP8 style checkpoint stores as FP8-block, and how.

Every Linear weight becomes float8_e4m3fn `weight` + fp32 `weight_scale_inv` `[ceil(out/128), ceil(in/128)]`,
except embeddings, lm_head, norms, the router (`mlp.gate.weight`, fp32 `e_score_correction_bias`),
DSA `indexer.weights_proj` and MTP `eh_proj`/`enorm`/`hnorm`, which stay as they were.
"""

from __future__ import annotations

import re

import torch

from kvq.checkpoint.module_kind import module_kind
from kvq.checkpoint.specs import TensorSpec
from kvq.formats.shapes import DEFAULT_BLOCK, scale_inv_shape

# DeepSeek-V3's config.json carries exactly these keys.
FP8_BLOCK_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(DEFAULT_BLOCK),
}
_KEPT_KINDS = {"embeddings", "norms", "router", "kv_scales"}
_KEPT_LINEARS = re.compile(r"\.indexer\.weights_proj\.weight$|(^|\.)eh_proj\.weight$")


def is_fp8_block_weight(spec: TensorSpec) -> bool:
    """True for a 2-D Linear `.weight` that FP8-block checkpoints store as float8_e4m3fn + scale."""
    return (
        len(spec.shape) == 2
        and spec.name.endswith(".weight")
        and module_kind(spec.name) not in _KEPT_KINDS
        and _KEPT_LINEARS.search(spec.name) is None
    )


def fp8_block_specs(spec: TensorSpec) -> list[TensorSpec]:
    """The stored tensors for one BF16 tensor: itself, or (fp8 `weight`, fp32 `weight_scale_inv`)."""
    if not is_fp8_block_weight(spec):
        return [spec]
    module = spec.name.removesuffix(".weight")
    return [
        TensorSpec(spec.name, spec.shape, torch.float8_e4m3fn),
        TensorSpec(f"{module}.weight_scale_inv", scale_inv_shape(spec.shape, DEFAULT_BLOCK), torch.float32),
    ]
