"""module_kind: tensor names from llama, GLM-4.5, GLM-5 (DSA, MTP) and compressed outputs."""

import pytest

from kvq.checkpoint.module_kind import module_kind


@pytest.mark.parametrize(
    "name, kind",
    [
        ("model.embed_tokens.weight", "embeddings"),
        ("lm_head.weight", "embeddings"),
        ("model.norm.weight", "norms"),
        ("model.layers.0.input_layernorm.weight", "norms"),
        ("model.layers.0.self_attn.kv_a_layernorm.weight", "norms"),
        ("model.layers.2.self_attn.indexer.k_norm.bias", "norms"),
        ("model.layers.3.mlp.gate.weight", "router"),
        ("model.layers.3.mlp.gate.e_score_correction_bias", "router"),
        ("model.layers.3.mlp.experts.7.up_proj.weight", "routed_experts"),
        ("model.layers.3.mlp.experts.7.up_proj.weight_packed", "routed_experts"),
        ("model.layers.3.mlp.shared_experts.down_proj.weight_scale_inv", "shared_experts"),
        ("model.layers.0.self_attn.kv_b_proj.weight", "attention"),
        ("model.layers.2.self_attn.indexer.weights_proj.weight", "attention"),
        ("model.layers.0.mlp.down_proj.weight", "dense_mlp"),
        ("model.layers.0.self_attn.k_scale", "kv_scales"),
        ("model.layers.78.eh_proj.weight", "other"),
    ],
)
def test_module_kind(name: str, kind: str) -> None:
    assert module_kind(name) == kind
