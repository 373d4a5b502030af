"""Running absolute maxima of what the KV cache stores, recorded as transformers would cache it.

`KvRecorder` is passed to a decoder layer as its `past_key_values`: attention calls
`update(key_states, value_states, layer_idx)` with post-RoPE K and V (`[B, H_kv, S, D]`) exactly where
a real cache would store them; the recorder keeps a running max of |K| and |V| per KV head (over every
sample ever seen, never the last batch alone) and returns the states unchanged, caching nothing. For
MLA models the latent is recorded instead: `kv_c` from a forward hook on `kv_a_layernorm` and `k_pe` from
the rope part of the key states. Imports torch and kvq.calibrate.observed_kv.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from kvq.calibrate.observed_kv import ObservedKV


class KvRecorder:
    """Per layer, per observed tensor (`k`/`v` or `kv_c`/`k_pe`): a running amax per KV head, fp32."""

    def __init__(self, layout: ObservedKV) -> None:
        self.layout = layout
        self.amax: dict[int, dict[str, torch.Tensor]] = {}  # layer -> name -> [num_kv_heads] fp32
        self.num_tokens: dict[int, int] = {}

    def observe(self, layer_idx: int, name: str, per_head_amax: torch.Tensor) -> None:
        seen = self.amax.setdefault(layer_idx, {})
        per_head_amax = per_head_amax.detach().to(torch.float32)
        seen[name] = per_head_amax if name not in seen else torch.maximum(seen[name], per_head_amax)

    # -- the slice of the transformers Cache interface that attention layers call --
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: object,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, _heads, seq, _dim = key_states.shape  # [B, H, S, D]
        self.num_tokens[layer_idx] = self.num_tokens.get(layer_idx, 0) + batch * seq
        if self.layout.is_mla:
            # Expanded keys repeat the shared RoPE part in every head: one head holds k_pe [B, S, rope].
            k_pe = key_states[:, 0, :, self.layout.qk_nope_head_dim :]
            self.observe(layer_idx, "k_pe", k_pe.abs().amax().reshape(1))
        else:
            self.observe(layer_idx, "k", key_states.abs().amax(dim=(0, 2, 3)))
            self.observe(layer_idx, "v", value_states.abs().amax(dim=(0, 2, 3)))
        return key_states, value_states

    def update_indexer(
        self, key_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> torch.Tensor:
        """DSA indexer keys (glm_moe_dsa): not part of the attention KV cache scales; passed through."""
        return key_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @contextmanager
    def latent_hook(self, attention: nn.Module, layer_idx: int) -> Iterator[None]:
        """While active, record `kv_c` = the `kv_a_layernorm` output of an MLA attention module."""
        if not self.layout.is_mla:
            yield
            return
        norm = getattr(attention, "kv_a_layernorm", None)
        assert norm is not None, f"MLA layer {layer_idx} has no kv_a_layernorm"

        def hook(_module: nn.Module, _args: object, output: torch.Tensor) -> None:
            self.observe(layer_idx, "kv_c", output.abs().amax().reshape(1))

        handle = norm.register_forward_hook(hook)
        try:
            yield
        finally:
            handle.remove()
