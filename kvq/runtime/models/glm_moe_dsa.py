"""GLM-5.x (`model_type: glm_moe_dsa`): DeepSeek-V3's model with DeepSeek Sparse Attention. Each layer's
DSA indexer (`layers.dsa_indexer`) picks the `index_topk` tokens each query attends to, from its own key
cache (index key rows beside the latent in the layer's pages); a `"shared"` layer of `indexer_types`
reuses the previous full layer's choice. RoPE is interleaved in attention and indexer alike; MoE layers
are those `mlp_layer_types` marks `"sparse"`. Imports torch and kvq.runtime.
"""

from __future__ import annotations

from kvq.errors import KvqError
from kvq.runtime.layers.dsa_indexer import Indexer, SharedSelection
from kvq.runtime.layers.mla import MLAttention
from kvq.runtime.layers.rotary import RotaryEmbedding
from kvq.runtime.loader import WeightLoader
from kvq.runtime.models.deepseek_v3 import DeepseekV3ForCausalLM
from kvq.runtime.models.glm4_moe import MoE
from kvq.runtime.models.llama import MLP, FeedForward, SelfAttention


class GlmMoeDsaForCausalLM(DeepseekV3ForCausalLM):
    def make_rotary(self, loader: WeightLoader) -> RotaryEmbedding:
        config = self.config
        return RotaryEmbedding(
            config,
            config.qk_rope_head_dim,
            self.max_positions,
            loader.dtype,
            loader.device,
            loader.cpu_ops,
            is_interleaved=True,
        )

    def make_attention(self, prefix: str, layer_idx: int, loader: WeightLoader) -> SelfAttention:
        if self.config.indexer_types[layer_idx] == "shared":
            full = [
                getattr(layer.self_attn, "indexer", None) for layer in self.layers
            ]  # built before this one
            indexer: Indexer | SharedSelection = SharedSelection(_last_full(full, layer_idx))
        else:
            indexer = Indexer(self.config, f"{prefix}.indexer", loader, self.rotary)
        return MLAttention(self.config, prefix, loader, self.rotary, indexer)

    def make_mlp(self, prefix: str, layer_idx: int, loader: WeightLoader) -> FeedForward:
        if self.config.mlp_layer_types[layer_idx] == "sparse":
            return MoE(self.config, prefix, loader)
        return MLP(prefix, loader, self.config.hidden_size, self.config.intermediate_size)


def _last_full(indexers: list, layer_idx: int) -> Indexer:
    """The last full indexer among the layers before `layer_idx`."""
    for indexer in reversed(indexers):
        if isinstance(indexer, Indexer):
            return indexer
    raise KvqError(
        f"config.json indexer_types[{layer_idx}] is 'shared' but no earlier layer is 'full': a shared DSA "
        "layer reuses the selection of the last full indexer layer before it; fix indexer_types"
    )
