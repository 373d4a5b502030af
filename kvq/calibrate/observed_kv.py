"""What a model's KV cache stores per token and layer, read from config.json and the tensor names.

GQA models (llama, glm4_moe, ...) cache post-RoPE K and V per KV head. MLA models (glm_moe_dsa,
DeepSeek-V3, Kimi K2: any config with `kv_lora_rank`) cache one latent per token: `kv_c` (the
`kv_a_layernorm` output, `kv_lora_rank` wide) next to `k_pe` (the RoPE'd key part, `qk_rope_head_dim`
wide), and vLLM / SGLang quantize that whole entry with the layer's single `k_scale`. The geometry is
`kvq.checkpoint.kv_cache_spec`'s (the one source the plan and the runtime pool use). Pure functions of
the config and the checkpoint's tensor names; imports kvq.checkpoint and kvq.errors only.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from kvq.checkpoint.kv_cache_spec import kv_cache_spec
from kvq.checkpoint.model_config import positive_int
from kvq.checkpoint.reader import Checkpoint
from kvq.errors import KvqError

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ObservedKV:
    """The cached tensors of one model: GQA (`k`, `v` per KV head) or MLA (`kv_c` + `k_pe` latent)."""

    kind: str  # "gqa" or "mla"
    num_layers: int
    num_kv_heads: int  # 1 for MLA: one latent per token
    head_dim: int  # GQA K/V head width; MLA latent width kv_lora_rank + qk_rope_head_dim
    max_positions: int
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kind == "mla"

    @property
    def observed(self) -> tuple[str, ...]:
        """The tensors observed per layer, by the names used in the manifest."""
        return ("kv_c", "k_pe") if self.is_mla else ("k", "v")


def observed_kv(config: dict, at: str) -> ObservedKV:
    """The KV layout of the language model whose config.json fields are `config` (`kvq.checkpoint.
    kv_cache_spec` reads them); `at` starts error messages ("path/config.json: text_config.")."""
    spec = kv_cache_spec(config, at)
    max_positions = int(config.get("max_position_embeddings") or 0)
    if spec.is_mla:
        nope = positive_int(config, "qk_nope_head_dim", at, "it splits the MLA key into k_nope and k_pe")
        return ObservedKV(
            "mla",
            spec.num_layers,
            1,
            spec.head_dim,
            max_positions,
            spec.kv_lora_rank,
            spec.qk_rope_head_dim,
            nope,
        )
    return ObservedKV("gqa", spec.num_layers, spec.num_kv_heads, spec.head_dim, max_positions)


def layer_tensor_names(ckpt: Checkpoint, num_layers: int) -> list[list[str]]:
    """The tensor names of each decoder layer 0..num_layers-1 (MTP layers past the end are skipped).

    Raises `KvqError` naming the first layer that stores no attention weights.
    """
    by_layer: dict[int, list[str]] = defaultdict(list)
    for name in ckpt.tensors:
        match = _LAYER.match(name)
        if match:
            by_layer[int(match[1])].append(name)
    for i in range(num_layers):
        if not any(".self_attn." in n for n in by_layer.get(i, [])):
            raise KvqError(
                f"{ckpt.root}: config.json declares {num_layers} layers but layer {i} has no "
                f"model.layers.{i}.self_attn.* tensors: no attention layer to calibrate; "
                "the checkpoint is incomplete or not a decoder-only transformer"
            )
    return [sorted(by_layer[i]) for i in range(num_layers)]
