"""config.json -> the language model: nested `text_config` (Kimi K2.6), kimi_k2 as DeepSeek-V3, the weight
prefix, and MLA / MoE / RoPE settings kvq does not implement refused by name with what is supported."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from transformers import DeepseekV3Config, GlmMoeDsaConfig

from kvq.checkpoint.model_config import (
    load_text_config,
    pretrained_config,
    quantization_config_of,
    read_text_model,
    text_model,
)
from kvq.errors import KvqError

DATA = Path(__file__).parents[1] / "compress" / "data"
KIMI = json.loads((DATA / "kimi-k2.6-config.json").read_text())
GLM5 = json.loads((DATA / "glm-5.1-config.json").read_text())


def test_kimi_k26_is_deepseek_v3_under_a_language_model_prefix(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(KIMI))
    model = read_text_model(tmp_path)
    assert (model.model_type, model.architecture, model.wrapper) == ("kimi_k2", "deepseek_v3", "kimi_k25")
    assert model.is_mla and model.weight_prefix == "language_model."
    assert model.quantization_config["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert model.checkpoint_name("model.layers.0.self_attn.q_a_proj.weight") == (
        "language_model.model.layers.0.self_attn.q_a_proj.weight"
    )
    assert model.hf_name("language_model.lm_head.weight") == "lm_head.weight"
    assert model.hf_name("vision_tower.patch_embed.proj.weight") is None
    config, prefix = load_text_config(tmp_path)
    assert isinstance(config, DeepseekV3Config) and prefix == "language_model."
    assert (config.num_hidden_layers, config.n_routed_experts, config.q_lora_rank) == (61, 384, 1536)
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 64.0
    assert config.rope_parameters["rope_theta"] == 50000.0
    assert not hasattr(config, "quantization_config")


def test_flat_configs_keep_their_names() -> None:
    model = text_model(GLM5, "glm-5.1/config.json")
    assert (model.architecture, model.weight_prefix, model.wrapper) == ("glm_moe_dsa", "", None)
    assert isinstance(pretrained_config(model), GlmMoeDsaConfig)
    assert text_model({"model_type": "llama"}, "c").hf_name("model.norm.weight") == "model.norm.weight"


def test_quantization_config_is_found_where_the_checkpoint_keeps_it() -> None:
    assert quantization_config_of(KIMI)["format"] == "pack-quantized"
    assert quantization_config_of({"model_type": "qwen3", "quantization_config": {"a": 1}}) == {"a": 1}
    assert quantization_config_of({"model_type": "llama"}) == {}


def _kimi(**text_fields: object) -> dict:
    config = copy.deepcopy(KIMI)
    for key, value in text_fields.items():
        if value is None:
            config["text_config"].pop(key)
        else:
            config["text_config"][key] = value
    return config


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            _kimi(topk_method="greedy"),
            r"text_config\.topk_method 'greedy' is not implemented.*supported topk_method: noaux_tc",
        ),
        (_kimi(topk_method="group_limited_greedy"), "'group_limited_greedy' is not implemented"),
        (
            _kimi(scoring_func="softmax"),
            r"text_config\.scoring_func 'softmax'.*supported scoring_func: sigmoid",
        ),
        (
            _kimi(rope_scaling={"type": "dynamic", "factor": 4.0}),
            r"text_config\.rope_scaling type 'dynamic' is not.*supported RoPE types: default, yarn",
        ),
        (_kimi(rope_scaling={"type": "yarn"}), r"rope_scaling\.factor is None; YaRN needs"),
        (_kimi(moe_layer_freq=2), "moe_layer_freq 2 is not implemented"),
        (_kimi(n_group=8, topk_group=9), "need 1 <= topk_group <= n_group"),
        (_kimi(n_group=5), "n_routed_experts 384 in n_group 5 groups"),
        (_kimi(num_experts_per_tok=0), "num_experts_per_tok 0: need 1 to 384"),
        (_kimi(kv_lora_rank=None), r"text_config\.kv_lora_rank is None; kimi_k2 is an MLA model"),
        (_kimi(model_type="qwen3"), r"text_config\.model_type 'qwen3'.*supported: kimi_k2, deepseek_v3"),
        ({**KIMI, "text_config": None}, "keeps its language model under 'text_config'"),
        (
            {**KIMI, "quantization_config": {"quant_method": "fp8"}},
            "quantization_config and text_config.quantization_config differ",
        ),
        ({"model_type": "mixtral"}, r"model_type 'mixtral'.*supported: llama, glm4_moe, .*kimi_k25 \(with"),
        ({"hidden_size": 8}, "no model_type"),
        ({**GLM5, "index_topk": 0}, "index_topk is 0; glm_moe_dsa has a DSA indexer"),
        (
            {"model_type": "llama", "rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
            "supported RoPE types: default, linear, llama3, yarn",
        ),
    ],
)
def test_unsupported_settings_are_refused_by_name(config: dict, message: str) -> None:
    with pytest.raises(KvqError, match=message):
        text_model(config, "config.json")


def test_the_published_settings_pass() -> None:
    for name in (
        "kimi-k2-config.json",
        "deepseek-r1-config.json",
        "glm-5.1-config.json",
        "kimi-k2.6-config.json",
    ):
        text_model(json.loads((DATA / name).read_text()), name)
    grouped = _kimi(n_group=8, topk_group=4)  # DeepSeek-V3's own grouping
    assert text_model(grouped, "c").fields["n_group"] == 8
