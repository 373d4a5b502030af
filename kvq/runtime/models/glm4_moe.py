"""GLM-4.5 (`model_type: glm4_moe`): Llama's attention with q/k/v bias and partial rotary, dense MLPs in
the first `first_k_dense_replace` layers, then mixture-of-experts MLPs.

Read top to bottom: router, MoE block, model. The router follows transformers' Glm4MoeTopkRouter:
sigmoid scores; experts chosen on scores + e_score_correction_bias (within the best topk_group of
n_group groups); weights from the unbiased scores, renormalized (norm_topk_prob), times
routed_scaling_factor. Imports torch and kvq.runtime.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from kvq.runtime.loader import WeightLoader
from kvq.runtime.models.llama import MLP, FeedForward, LlamaForCausalLM


class TopkRouter:
    def __init__(self, config: PretrainedConfig, prefix: str, loader: WeightLoader) -> None:
        self.num_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = loader.tensor(f"{prefix}.weight", (self.num_experts, config.hidden_size), torch.float32)
        self.e_score_correction_bias = loader.tensor(
            f"{prefix}.e_score_correction_bias", (self.num_experts,), torch.float32
        )

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, H]` -> (topk_ids `[T, k]`, topk_weights fp32 `[T, k]`)."""
        scores = F.linear(x.float(), self.weight).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)  # [T, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
            group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
            choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).flatten(1)
        topk_ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        topk_weights = scores.gather(1, topk_ids)
        if self.norm_topk_prob:
            topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_ids, topk_weights * self.routed_scaling_factor

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.e_score_correction_bias]


class MoE:
    """Routed experts (top-k of n_routed_experts) plus always-on shared experts."""

    def __init__(self, config: PretrainedConfig, prefix: str, loader: WeightLoader) -> None:
        hidden, intermediate = config.hidden_size, config.moe_intermediate_size
        self.gate = TopkRouter(config, f"{prefix}.gate", loader)
        self.experts = loader.experts(f"{prefix}.experts", config.n_routed_experts, hidden, intermediate)
        self.shared_experts = MLP(
            f"{prefix}.shared_experts",
            loader,
            hidden,
            intermediate * config.n_shared_experts,
            is_partial=True,
        )
        self.all_reduce = loader.tp.all_reduce_or_none

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Under tensor parallelism every rank runs every routed expert on its share of the expert's
        intermediate dimension (as the shared experts): one all-reduce sums both."""
        topk_ids, topk_weights = self.gate(x)
        y = self.experts(x, topk_ids, topk_weights) + self.shared_experts(x)
        return y if self.all_reduce is None else self.all_reduce(y)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.gate.tensors(), *self.experts.tensors(), *self.shared_experts.tensors()]


class Glm4MoeForCausalLM(LlamaForCausalLM):
    """Llama's layout with MoE MLPs from layer `first_k_dense_replace` on (bias and partial rotary come
    from the config: `attention_bias`, `partial_rotary_factor`)."""

    def make_mlp(self, prefix: str, layer_idx: int, loader: WeightLoader) -> FeedForward:
        if layer_idx < self.config.first_k_dense_replace:
            return MLP(prefix, loader, self.config.hidden_size, self.config.intermediate_size)
        return MoE(self.config, prefix, loader)
