"""Rotary position embedding on the first `rotary_dim` channels of each head.

Rotate-half (Llama the whole head, GLM-4.5 the first half: partial_rotary_factor 0.5), as transformers'
`apply_rotary_pos_emb`; or interleaved pairs (MLA's q_pe / k_pe and GLM-5's DSA indexer), as its
`apply_rotary_pos_emb_interleave`, which also writes the rotated pairs de-interleaved (evens, then odds).
Frequencies and the cos/sin scaling come from transformers' rope initializers, so every rope type it
knows (default, llama3, yarn with its attention factor, ...) gives the same tables. Rotate-half on CPU
bf16 runs kvq's C op (the engine's `CpuOps.rotary`, the same rounding). Imports torch, transformers and
kvq.runtime.kernels.cpu.ops.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvq.errors import KvqError
from kvq.runtime.kernels.cpu.ops import CpuOps


def _default_inv_freq(config: PretrainedConfig, rotary_dim: int) -> torch.Tensor:
    base = config.rope_parameters["rope_theta"]
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


class RotaryEmbedding:
    def __init__(
        self,
        config: PretrainedConfig,
        head_dim: int,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        ops: CpuOps,
        *,
        is_interleaved: bool = False,
    ) -> None:
        # the engine's CPU kernels where they run (rotate-half on CPU), else None: torch's ops
        self.ops = None if is_interleaved else ops.on(device)
        params = config.rope_parameters or {}
        self.rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            inv_freq, scaling = _default_inv_freq(config, self.rotary_dim), 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        else:
            raise KvqError(
                f"config.json rope_type {rope_type!r} is unknown to transformers; "
                f"known: default, {', '.join(ROPE_INIT_FUNCTIONS)}"
            )
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())  # [P, R/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, R]
        # tables in the activation dtype, as transformers casts them (bf16 math in the fast path)
        half, self.is_interleaved = self.rotary_dim // 2, is_interleaved
        cos, sin = emb.cos() * scaling, emb.sin() * scaling
        if is_interleaved:  # pair i turns by frequency i: the first half of cat(freqs, freqs)
            self.cos = cos[:, :half].to(device=device, dtype=dtype)
            self.sin_signed = sin[:, :half].to(device=device, dtype=dtype)
            return
        self.cos = cos.to(device=device, dtype=dtype)
        # rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin2): one op fewer
        self.sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).to(device=device, dtype=dtype)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[T, 1, R]` at `positions` `[T]`: looked up once per step, used by every layer."""
        return self.cos[positions][:, None, :], self.sin_signed[positions][:, None, :]

    def __call__(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Heads `[T, H, D]` (q and k heads side by side) rotated, in x.dtype."""
        cos, sin_signed = cos_sin
        if self.ops is not None and self.ops.rotary_applies(x, cos, sin_signed):  # CPU bf16: one C call
            return self.ops.rotary(x, cos, sin_signed, self.rotary_dim)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.is_interleaved:  # sin_signed holds plain sin here
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.cat([x1 * cos - x2 * sin_signed, x2 * cos + x1 * sin_signed], dim=-1)
        else:
            x1, x2 = rot.chunk(2, dim=-1)
            rotated = torch.addcmul(rot * cos, torch.cat([x2, x1], dim=-1), sin_signed)
        return rotated if rest.shape[-1] == 0 else torch.cat([rotated, rest], dim=-1)
