"""DeepSeek-V3 and Kimi K2 (`model_type: deepseek_v3`, `kimi_k2`): multi-head latent attention over the
paged latent pool, GLM-4.5's MoE (DeepSeek-V3's `noaux_tc` router: sigmoid scores, the
`e_score_correction_bias` choice within the best `topk_group` of `n_group` groups, renormalized weights
times `routed_scaling_factor`) from layer `first_k_dense_replace` on, dense MLPs before.

Read top to bottom: the model is Llama's layout (`llama`) with `glm4_moe`'s MLPs, `layers.mla`'s
attention and RoPE on the `qk_rope_head_dim` channels, interleaved when `rope_interleave` (the default),
YaRN with its mscale from the config (Kimi K2: factor 64). MTP layers (`num_nextn_predict_layers`) are
stored past the last decoder layer and are not loaded (the loader notes them). Imports torch and
kvq.runtime.
"""

from __future__ import annotations

from kvq.runtime.layers.mla import MLAttention
from kvq.runtime.layers.rotary import RotaryEmbedding
from kvq.runtime.loader import WeightLoader
from kvq.runtime.models.glm4_moe import Glm4MoeForCausalLM
from kvq.runtime.models.llama import SelfAttention


class DeepseekV3ForCausalLM(Glm4MoeForCausalLM):
    def make_rotary(self, loader: WeightLoader) -> RotaryEmbedding:
        is_interleaved = getattr(self.config, "rope_interleave", True)
        return RotaryEmbedding(
            self.config,
            self.config.qk_rope_head_dim,
            self.max_positions,
            loader.dtype,
            loader.device,
            loader.cpu_ops,
            is_interleaved=is_interleaved,
        )

    def make_attention(self, prefix: str, layer_idx: int, loader: WeightLoader) -> SelfAttention:
        return MLAttention(self.config, prefix, loader, self.rotary)
