"""Tiny/bench model configs, seeded tensors and the fused <-> per-expert layout."""

from __future__ import annotations

import math

import pytest
import torch

from kvq.checkpoint.expert_layout import fuse_experts, split_expert_shapes
from kvq.checkpoint.fp8_block_layout import fp8_block_specs
from kvq.checkpoint.model_config import text_model
from kvq.checkpoint.specs import TensorSpec, checkpoint_specs
from kvq.errors import KvqError
from kvq.testing.checkpoint_fixtures import config_json
from kvq.testing.tiny_models import ARCHITECTURES, build_model, random_tensor, tiny_config


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tiny_config_dimensions(arch):
    config = tiny_config(arch)
    assert config.hidden_size == 256 and config.head_dim % 32 == 0
    assert config.num_hidden_layers in (2, 3, 4)
    assert tiny_config(arch, num_layers=8).num_hidden_layers == 8


def test_glm_configs_carry_the_real_features():
    glm4 = tiny_config("glm4_moe")
    assert glm4.rope_parameters["partial_rotary_factor"] == 0.5
    assert (glm4.n_routed_experts, glm4.num_experts_per_tok, glm4.first_k_dense_replace) == (8, 2, 1)
    dsa = tiny_config("glm_moe_dsa")
    assert dsa.mlp_layer_types == ["dense", "sparse", "sparse"]
    assert dsa.index_topk == 8 and dsa.q_lora_rank % 128 != 0 and dsa.kv_lora_rank % 128 == 0


def test_deepseek_v3_is_kimi_shaped():
    config = tiny_config("deepseek_v3")
    assert (config.n_group, config.topk_group, config.topk_method, config.scoring_func) == (
        4,
        2,
        "noaux_tc",
        "sigmoid",
    )
    rope = config.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["mscale"], rope["mscale_all_dim"]) == (
        "yarn",
        64.0,
        1.0,
        1.0,
    )
    assert rope["original_max_position_embeddings"] * 64 == config.max_position_embeddings
    assert (
        config.q_lora_rank % 128 != 0
        and config.v_head_dim != config.qk_nope_head_dim + config.qk_rope_head_dim
    )
    assert (config.first_k_dense_replace, config.n_shared_experts, config.routed_scaling_factor) == (
        1,
        1,
        2.827,
    )
    model = text_model(config_json(config), "config.json")  # kvq accepts what it builds
    assert model.is_mla and model.architecture == "deepseek_v3"


def test_deepseek_v3_router_group_limit_changes_the_choice():
    """With n_group 4 / topk_group 2 the grouped top-k differs from a plain top-k for some tokens."""
    model = build_model(tiny_config("deepseek_v3"))
    router = model.model.layers[1].mlp.gate
    hidden = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    _, _, grouped = router(hidden)
    with torch.no_grad():
        scores = (hidden @ router.weight.float().T).sigmoid() + router.e_score_correction_bias
    plain = scores.topk(2, dim=-1).indices
    assert (grouped.sort(-1).values != plain.sort(-1).values).any(dim=-1).float().mean() > 0.02


def test_num_layers_must_leave_a_moe_layer():
    with pytest.raises(KvqError, match="num_layers"):
        tiny_config("glm4_moe", num_layers=1)


@pytest.mark.parametrize("arch", ["glm4_moe", "llama"])
def test_bench_size_is_one_to_two_gigabytes_as_fp8(arch):
    config = tiny_config(arch, size="bench")
    specs = [s for spec in checkpoint_specs(config) for s in fp8_block_specs(spec)]
    nbytes = sum(math.prod(s.shape) * s.dtype.itemsize for s in specs)
    assert 0.7e9 < nbytes < 2.2e9
    assert config.num_hidden_layers >= 8


def test_random_tensor_depends_on_seed_and_name_only():
    spec = TensorSpec("model.layers.0.mlp.up_proj.weight", (64, 32), torch.bfloat16)
    other = TensorSpec("model.layers.1.mlp.up_proj.weight", (64, 32), torch.bfloat16)
    a = random_tensor(spec, seed=0)
    assert torch.equal(a, random_tensor(spec, seed=0))
    assert not torch.equal(a, random_tensor(spec, seed=1))
    assert not torch.equal(a, random_tensor(other, seed=0))
    assert 0.015 < a.float().std() < 0.025
    bias_spec = TensorSpec("model.layers.1.mlp.gate.e_score_correction_bias", (8,), torch.float32)
    bias = random_tensor(bias_spec, seed=0)
    assert bias.dtype == torch.float32 and (bias >= 0).all() and bias.max() < 0.1 and bias.std() > 0
    norm = random_tensor(TensorSpec("model.norm.weight", (256,), torch.bfloat16), 0).float()
    assert (norm - 1).abs().max() < 0.3 and norm.std() > 0.01


def test_split_and_fuse_experts_round_trip():
    gate_up = torch.randn(3, 2 * 5, 7)  # [E, 2I, H]
    down = torch.randn(3, 7, 5)  # [E, H, I]
    split = {"m.mlp.experts.gate_up_proj": gate_up, "m.mlp.experts.down_proj": down}
    names = split_expert_shapes("m.mlp.experts.gate_up_proj", (3, 10, 7))
    assert names[:2] == [
        ("m.mlp.experts.0.gate_proj.weight", (5, 7)),
        ("m.mlp.experts.0.up_proj.weight", (5, 7)),
    ]
    down_names = split_expert_shapes("m.mlp.experts.down_proj", (3, 7, 5))
    assert down_names[2] == ("m.mlp.experts.2.down_proj.weight", (7, 5))
    per_expert = {}
    for e in range(3):
        per_expert[f"m.mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :5]
        per_expert[f"m.mlp.experts.{e}.up_proj.weight"] = gate_up[e, 5:]
        per_expert[f"m.mlp.experts.{e}.down_proj.weight"] = down[e]
    fused = fuse_experts({**per_expert, "m.norm.weight": torch.ones(7)})
    assert torch.equal(fused["m.mlp.experts.gate_up_proj"], split["m.mlp.experts.gate_up_proj"])
    assert torch.equal(fused["m.mlp.experts.down_proj"], split["m.mlp.experts.down_proj"])
    assert "m.norm.weight" in fused and len(fused) == 3
