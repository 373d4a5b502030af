"""From observed maxima to the `k_scale` / `v_scale` tensors servers load: `scale = amax / 448`, bf16.

GQA: `model.layers.{i}.self_attn.k_scale` from |K| and `v_scale` from |V|, shape `[1]` (strategy tensor)
or `[num_kv_heads, 1, 1]` (attn_head). MLA: the cache entry is `kv_c ++ k_pe` quantized with one scale
(vLLM `concat_and_cache_mla(kv_c, k_pe, ..., scale=k_scale)`), so `k_scale` covers
`max(amax(kv_c), amax(k_pe))`; `v_scale` gets the same value (both name the one latent entry).
A zero amax gets bf16's eps, as compressed-tensors does. Pure tensor functions.
"""

from __future__ import annotations

import torch

from kvq.calibrate.observed_kv import ObservedKV
from kvq.formats.fp8_e4m3 import FP8_E4M3_MAX

SCALE_DTYPE = torch.bfloat16


def scale_names(layer_idx: int) -> tuple[str, str]:
    prefix = f"model.layers.{layer_idx}.self_attn"
    return f"{prefix}.k_scale", f"{prefix}.v_scale"


def amax_to_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 amax (any shape) -> bf16 scale `amax / 448`, zeros replaced by bf16 eps."""
    scale = (amax.to(torch.float32) / FP8_E4M3_MAX).to(SCALE_DTYPE)
    return torch.where(scale == 0, torch.tensor(torch.finfo(SCALE_DTYPE).eps, dtype=SCALE_DTYPE), scale)


def cached_amax(layout: ObservedKV, observed: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-KV-head amax `[H_kv]` of what the K and V scales must cover, from one layer's observations."""
    if layout.is_mla:
        latent = torch.maximum(observed["kv_c"], observed["k_pe"])  # [1]
        return latent, latent
    return observed["k"], observed["v"]


def layer_scales(
    layout: ObservedKV, strategy: str, layer_idx: int, observed: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`{k_scale name: tensor, v_scale name: tensor}` of one layer for `strategy` (tensor | attn_head)."""
    k_amax, v_amax = cached_amax(layout, observed)
    k_name, v_name = scale_names(layer_idx)
    if strategy == "tensor":
        return {
            k_name: amax_to_scale(k_amax.amax().reshape(1)),
            v_name: amax_to_scale(v_amax.amax().reshape(1)),
        }
    assert strategy == "attn_head" and not layout.is_mla, strategy
    return {k_name: amax_to_scale(k_amax).reshape(-1, 1, 1), v_name: amax_to_scale(v_amax).reshape(-1, 1, 1)}
