"""What an FP8 (e4m3) KV cache does to K and V, as a reference forward can apply it (fake quantization).

`fake_quantize_fp8(x, scale) = fp8(clamp(x / scale, ±448)) * scale`: the round trip a server makes when it
stores K/V in float8_e4m3fn pages with static scales and reads them back. `FakeQuantKVCache` is a
transformers `DynamicCache` that applies it to everything attention caches (post-RoPE K and V, GQA
models), so a plain whole-model forward shows the accuracy of FP8 KV until the runtime serves it.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig

from kvq.formats.fp8_e4m3 import FP8_E4M3_MAX

KvScales = dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (k_scale, v_scale), [1] or [H_kv, 1, 1]


def fake_quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`[B, H, S, D]` states through an e4m3 round trip with `scale` (`[1]` or `[H, 1, 1]`), in x's dtype."""
    scale = scale.to(torch.float32)
    q = (x.to(torch.float32) / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.to(torch.float32) * scale).to(x.dtype)


def unit_scales(num_layers: int) -> KvScales:
    """Scale 1.0 everywhere: what servers use when a checkpoint carries no KV scales."""
    one = torch.ones(1)
    return {i: (one, one) for i in range(num_layers)}


def scales_from_tensors(tensors: dict[str, torch.Tensor], num_layers: int) -> KvScales:
    """`model.layers.{i}.self_attn.k_scale` / `v_scale` tensors -> per-layer pairs."""
    prefix = "model.layers.{}.self_attn."
    return {
        i: (tensors[prefix.format(i) + "k_scale"], tensors[prefix.format(i) + "v_scale"])
        for i in range(num_layers)
    }


class FakeQuantKVCache(DynamicCache):
    """A DynamicCache whose stored (and returned) K/V go through `fake_quantize_fp8` with per-layer scales."""

    def __init__(self, config: PretrainedConfig, kv_scales: KvScales) -> None:
        super().__init__(config=config)
        self.kv_scales = kv_scales

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: object,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k_scale, v_scale = self.kv_scales[layer_idx]
        return super().update(
            fake_quantize_fp8(key_states, k_scale),
            fake_quantize_fp8(value_states, v_scale),
            layer_idx,
            *args,
            **kwargs,
        )
