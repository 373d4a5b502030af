"""Small random models of the architectures kvq handles, for tests ("tiny") and benchmarks ("bench").

Dimensions are chosen to hit real edge cases: hidden 256 / head_dim 64 keep most attention and expert
Linear input dims multiples of 128 (INT4 group-128 has work, vLLM CPU FP8 KV needs head_dim % 32 == 0),
while the dense MLP (intermediate 576) and the MLA q_lora ranks (DSA 192, DeepSeek-V3 160) give input dims
that are not (partial FP8 blocks, skipped by group-128). `deepseek_v3` is shaped like Kimi K2: a grouped
sigmoid router (`n_group` 4, `topk_group` 2, `noaux_tc`), YaRN with Kimi's mscale (factor 64 over an
original context of 64), one dense first layer, a shared expert, v_head_dim != qk_head_dim. Weights are
drawn per on-disk tensor name from a seeded generator, so a tensor's values depend only on (seed, name,
shape) and any fixture can be built shard by shard.
"""

from __future__ import annotations

import hashlib

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Glm4MoeConfig,
    GlmMoeDsaConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from kvq.checkpoint.expert_layout import fuse_experts
from kvq.checkpoint.specs import TensorSpec, checkpoint_specs, meta_model
from kvq.errors import KvqError
from kvq.testing.tiny_tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB_SIZE

ARCHITECTURES = ("llama", "glm4_moe", "glm_moe_dsa", "deepseek_v3")
SIZES = ("tiny", "bench")
INIT_STD = 0.02  # transformers' initializer_range default

_ATTENTION = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
_MOE = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
}
# Kimi K2's router (its config.json has n_group 1 / topk_group 1; grouped here so the group
# limit is exercised, as in DeepSeek-V3's 8 / 4), scaled down.
_KIMI_MOE = {
    **_MOE,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.827,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
}
# The MLA models (glm_moe_dsa, deepseek_v3) share their attention and MoE sizes.
_MLA_TINY = {
    "hidden_size": 256,
    "intermediate_size": 576,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
}
_MLA_BENCH = {
    **_MLA_TINY,
    "hidden_size": 1024,
    "intermediate_size": 2880,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 10,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 256,
}
_BENCH_EXPERTS = {"n_routed_experts": 64, "num_experts_per_tok": 4}
_DIMS: dict[str, dict[str, dict]] = {
    "llama": {
        "tiny": {"hidden_size": 256, "intermediate_size": 576, "num_hidden_layers": 2, **_ATTENTION},
        "bench": {
            "hidden_size": 2048,
            "intermediate_size": 5760,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
        },
    },
    "glm4_moe": {
        "tiny": {
            "hidden_size": 256,
            "intermediate_size": 576,
            "moe_intermediate_size": 128,
            "num_hidden_layers": 3,
            **_ATTENTION,
            **_MOE,
        },
        # ~1.4 G parameters: about 1.4 GB as FP8-block, 2.8 GB as BF16.
        "bench": {
            "hidden_size": 1024,
            "intermediate_size": 2880,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 10,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 64,
            **_MOE,
            "n_routed_experts": 64,
            "num_experts_per_tok": 4,
        },
    },
    "glm_moe_dsa": {
        "tiny": {
            **_MLA_TINY,
            "q_lora_rank": 192,
            "index_topk": 8,
            "index_head_dim": 128,
            "index_n_heads": 4,
            **_MOE,
        },
        "bench": {
            **_MLA_BENCH,
            "q_lora_rank": 384,
            "index_topk": 64,
            "index_head_dim": 128,
            "index_n_heads": 8,
            **_MOE,
            **_BENCH_EXPERTS,
        },
    },
    "deepseek_v3": {
        "tiny": {**_MLA_TINY, "q_lora_rank": 160, **_KIMI_MOE},
        "bench": {
            **_MLA_BENCH,
            "q_lora_rank": 416,
            **_KIMI_MOE,
            **_BENCH_EXPERTS,
            "n_group": 8,
            "topk_group": 4,
        },
    },
}
_CONFIG_CLASSES = {
    "llama": LlamaConfig,
    "glm4_moe": Glm4MoeConfig,
    "glm_moe_dsa": GlmMoeDsaConfig,
    "deepseek_v3": DeepseekV3Config,
}
MAX_POSITIONS = 4096
_ARCH_EXTRAS: dict[str, dict] = {
    "llama": {"tie_word_embeddings": False},
    # GLM-4.5: q/k/v biases, half the head dim rotated. No MTP layer: transformers 5.17 only skips MTP
    # weights stored as layer 46/92 (`_keys_to_ignore_on_load_unexpected`), so a tiny one would be unexpected.
    "glm4_moe": {
        "attention_bias": True,
        "use_qk_norm": False,
        "partial_rotary_factor": 0.5,
        "num_mtp_layers": 0,
    },
    "glm_moe_dsa": {"attention_bias": False},
    # Kimi K2.6's rope_scaling with the same factor and mscales; no MTP layer (Kimi ships none).
    "deepseek_v3": {
        "attention_bias": False,
        "num_nextn_predict_layers": 0,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 50000.0,
            "factor": 64.0,
            "original_max_position_embeddings": MAX_POSITIONS // 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
}


def tiny_config(
    arch: str,
    *,
    num_layers: int | None = None,
    size: str = "tiny",
    vocab_size: int = VOCAB_SIZE,
    bos_token_id: int | None = BOS_TOKEN_ID,
    eos_token_id: int | None = EOS_TOKEN_ID,
    pad_token_id: int | None = BOS_TOKEN_ID,
) -> PretrainedConfig:
    """The transformers config of a small `arch` model; `num_layers` overrides the size's default depth.

    Vocabulary and special token ids default to the fixture tokenizer's (`tiny_tokenizer`).
    """
    if arch not in ARCHITECTURES:
        raise KvqError(f"architecture {arch!r} has no tiny model; pick one of {', '.join(ARCHITECTURES)}")
    if size not in SIZES:
        raise KvqError(f"fixture size {size!r} is unknown; pick one of {', '.join(SIZES)}")
    dims = dict(_DIMS[arch][size])
    if num_layers is not None:
        first_dense = dims.get("first_k_dense_replace", 0)
        if num_layers <= first_dense:
            raise KvqError(
                f"num_layers={num_layers} leaves no MoE layer for {arch} "
                f"(first {first_dense} layer(s) are dense); pass num_layers >= {first_dense + 1}"
            )
        dims["num_hidden_layers"] = num_layers
    config = _CONFIG_CLASSES[arch](
        vocab_size=vocab_size,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        initializer_range=INIT_STD,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        **dims,
        **_ARCH_EXTRAS[arch],
    )
    config.architectures = [_causal_lm_class_name(config)]
    config.dtype = torch.bfloat16
    return config


def _causal_lm_class_name(config: PretrainedConfig) -> str:
    return type(meta_model(config)).__name__


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def random_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    """The fixture value of one tensor: a function of (seed, name, shape) only.

    Linear/embedding weights ~ N(0, 0.02) as HF initializes them; norm weights 1 + N(0, 0.05) so a
    forgotten norm weight changes results; biases N(0, 0.02); `e_score_correction_bias` in [0, 0.1)
    so the sigmoid router's correction actually moves the top-k.
    """
    gen = _generator(seed, spec.name)
    leaf = spec.name.rsplit(".", 1)[-1]
    if leaf == "e_score_correction_bias":
        values = 0.1 * torch.rand(spec.shape, generator=gen)
    elif "norm" in spec.name and leaf == "weight":
        values = 1.0 + 0.05 * torch.randn(spec.shape, generator=gen)
    else:
        values = INIT_STD * torch.randn(spec.shape, generator=gen)
    return values.to(spec.dtype)


def build_model(config: PretrainedConfig, *, seed: int = 0) -> PreTrainedModel:
    """The random model in memory (eval mode, bf16) holding exactly the fixture's BF16 tensors."""
    tensors = {spec.name: random_tensor(spec, seed) for spec in checkpoint_specs(config)}
    return load_tensors(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16), tensors)


def load_tensors(model: PreTrainedModel, tensors: dict[str, torch.Tensor]) -> PreTrainedModel:
    """`model` (eval mode) holding the per-expert on-disk `tensors` (transformers names), every one.

    The fp32 router `e_score_correction_bias` stays fp32, as `from_pretrained` keeps it
    (`_keep_in_fp32_modules_strict`); `from_config` makes DeepSeek-V3's in the model dtype.
    """
    missing, unexpected = model.load_state_dict(fuse_experts(tensors), strict=False)
    assert not unexpected, unexpected
    assert all("inv_freq" in k for k in missing), missing
    for name, buffer in list(model.named_buffers()):
        if name.endswith("e_score_correction_bias") and buffer.dtype != tensors[name].dtype:
            module, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(module), leaf, tensors[name].clone())
    return model.eval()
