"""A tiny Kimi-K2-native INT4 checkpoint, written without kvq compress: the DeepSeek-V3 architecture
(model_type kimi_k2, with the remote code's auto_map), routed experts packed INT4 group 32 by
compressed-tensors itself, everything else BF16, and Kimi K2 Thinking's quantization_config."""

from __future__ import annotations

import json
import re
from pathlib import Path

from transformers import DeepseekV3Config

from kvq.checkpoint.hf_checkpoint import config_json
from kvq.checkpoint.specs import checkpoint_specs
from kvq.checkpoint.write import save_safetensors_atomic
from kvq.fixtures.kimi_fixture import QUANTIZATION_CONFIG
from kvq.fixtures.tiny_models import random_tensor
from kvq.fixtures.tiny_tokenizer import VOCAB_SIZE

ROUTED = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
# Kimi K2 Thinking / K2.5 / K2.6 (DESIGN.md): one group under `Linear`, INT4 group 32, only routed experts
KIMI_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "dynamic": False,
                "actorder": None,
                "observer": "minmax",
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": QUANTIZATION_CONFIG["ignore"],  # as K2.6's
    "kv_cache_scheme": None,
}


def build_kimi_int4(out: Path) -> Path:
    from tests.compress.oracle import library_quantize

    config = DeepseekV3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    )
    tensors = {}
    for spec in checkpoint_specs(config):
        weight = random_tensor(spec, seed=0)
        if ROUTED.search(spec.name):
            module = spec.name.removesuffix(".weight")
            tensors.update({f"{module}.{k}": v for k, v in library_quantize(weight, 32).items()})
        else:
            tensors[spec.name] = weight
    out.mkdir(parents=True)
    save_safetensors_atomic(tensors, out / "model.safetensors")
    data = config_json(config)
    data.update(
        model_type="kimi_k2",
        architectures=["DeepseekV3ForCausalLM"],
        auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
        quantization_config=KIMI_QUANTIZATION_CONFIG,
    )
    (out / "config.json").write_text(json.dumps(data))
    return out
