"""KV bytes per token from config.json (MLA latent vs GQA K+V) and what fits beside the weights."""

from __future__ import annotations

from kvq.compress.serving_memory import kv_bytes_per_token, serving_memory

LLAMA = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
MLA = {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_attention_heads": 128}


def test_gqa_kv_is_split_across_ranks_down_to_one_head():
    assert kv_bytes_per_token(LLAMA, "bf16", 1)[0] == 30 * 2 * 3 * 64 * 2
    assert kv_bytes_per_token(LLAMA, "fp8_e4m3", 8)[0] == 30 * 2 * 1 * 64  # 3 heads on 8 ranks: one each


def test_mla_caches_the_latent_on_every_rank():
    assert kv_bytes_per_token(MLA, "bf16", 8)[0] == 61 * 576 * 2
    dsa = {**MLA, "index_topk": 2048, "index_head_dim": 128}
    assert kv_bytes_per_token(dsa, "fp8_e4m3", 8)[0] == 61 * (576 + 128)


def test_tokens_that_fit():
    memory = serving_memory(LLAMA, 10**9, 1, 2 * 10**9, "bf16")
    assert memory.weight_bytes_per_gpu == 10**9 and memory.kv_tokens == 10**9 // (30 * 2 * 3 * 64 * 2)
    assert serving_memory(LLAMA, 3 * 10**9, 1, 2 * 10**9, "bf16").kv_tokens == 0


def test_auto_is_fp8_for_a_calibrated_checkpoint_else_bf16():
    calibrated = {**LLAMA, "quantization_config": {"kv_cache_scheme": {"num_bits": 8, "type": "float"}}}
    assert serving_memory(calibrated, 10**9, 1, 2 * 10**9, "auto").kv_cache_dtype == "fp8_e4m3"
    assert serving_memory(LLAMA, 10**9, 1, 2 * 10**9, "auto").kv_cache_dtype == "bf16"
