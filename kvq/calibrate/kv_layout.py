"""What a model's KV cache stores per token and layer, read from config.json and the tensor names.

GQA models (llama, glm4_moe, ...) cache post-RoPE K and V per KV head. MLA models (glm_moe_dsa,
DeepSeek-V3, Kimi K2: any config with `kv_lora_rank`) cache one latent per token: `kv_c` (the
`kv_a_layernorm` output, `kv_lora_rank` wide) next to `k_pe` (the RoPE'd key part, `qk_rope_head_dim`
wide), and vLLM / SGLang quantize that whole entry with the layer's single `k_scale`. Pure functions of
the config and the checkpoint's tensor names; imports kvq.checkpoint and kvq.errors only.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from kvq.checkpoint.reader import Checkpoint
from kvq.errors import KvqError

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class KvLayout:
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


def kv_layout(config: dict, where: str) -> KvLayout:
    """The KV layout declared by a config.json dict; `where` names the file in errors."""
    text = config
    num_layers = int(text.get("num_hidden_layers") or 0)
    max_positions = int(text.get("max_position_embeddings") or 0)
    if num_layers < 1:
        raise KvqError(
            f"{where}: num_hidden_layers is {num_layers}: this model has no attention layers, "
            "so it has no KV cache to calibrate"
        )
    if text.get("kv_lora_rank"):
        rank, rope, nope = (int(text[k]) for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim"))
        return KvLayout("mla", num_layers, 1, rank + rope, max_positions, rank, rope, nope)
    if not text.get("num_attention_heads"):
        raise KvqError(
            f"{where}: no num_attention_heads and no kv_lora_rank: kvq cannot tell what the KV "
            "cache of this model holds; is it a decoder-only transformer?"
        )
    num_heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // num_heads)
    num_kv_heads = int(text.get("num_key_value_heads") or num_heads)
    return KvLayout("gqa", num_layers, num_kv_heads, head_dim, max_positions)


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
