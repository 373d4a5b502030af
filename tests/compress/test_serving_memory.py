"""Weights per GPU as a tensor-parallel server places them, and the BF16 / FP8 KV tokens that fit beside."""

from __future__ import annotations

import pytest

from kvq.checkpoint.kv_cache_spec import kv_cache_spec
from kvq.compress.serving_memory import serving_memory, weight_bytes
from kvq.errors import KvqError

LLAMA = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
MLA = {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_attention_heads": 128}


def test_weights_are_replicated_split_or_mtp():
    tensors = [
        ("language_model.model.layers.0.self_attn.q_a_proj.weight", 100),  # replicated (vLLM disable_tp)
        ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", 10),
        ("model.layers.0.self_attn.q_b_proj.weight", 800),  # split by heads
        ("model.layers.1.mlp.gate.weight", 7),  # router: replicated
        ("model.layers.1.mlp.gate.e_score_correction_bias", 1),
        ("model.layers.1.mlp.experts.3.up_proj.weight_packed", 1600),  # split
        ("model.layers.1.mlp.experts.3.up_proj.weight_shape", 16),  # every rank keeps the two integers
        ("model.layers.1.self_attn.indexer.wk.weight", 20),  # DSA indexer: replicated
        ("model.layers.1.input_layernorm.weight", 2),
        ("model.layers.0.self_attn.k_scale", 2),
        ("model.embed_tokens.weight", 3200),  # vocab-parallel
        ("model.layers.2.eh_proj.weight", 5000),  # MTP layer 2 of a 2-layer model: not loaded
    ]
    weights = weight_bytes(tensors, num_layers=2)
    assert (weights.replicated, weights.split, weights.mtp) == (158, 5600, 5000)
    assert weights.per_gpu(8) == 158 + 700 and weights.per_gpu(3) == 158 + 1867


def test_tokens_that_fit_for_both_kv_dtypes():
    weights = weight_bytes([("model.layers.0.mlp.up_proj.weight", 8 * 10**9)], num_layers=61)
    memory = serving_memory(kv_cache_spec(MLA, "c: "), weights, 8, 100 * 10**9, mem_fraction=0.5)
    assert memory.weight_bytes_per_gpu == 10**9 and memory.kv_budget_bytes == 49 * 10**9
    bf16, fp8 = memory.kv
    assert (bf16.bytes_per_token, fp8.bytes_per_token) == (61 * 576 * 2, 61 * 576)
    assert bf16.tokens == 49 * 10**9 // (61 * 576 * 2) and fp8.tokens == 49 * 10**9 // (61 * 576)
    gqa = serving_memory(kv_cache_spec(LLAMA, "c: "), weights, 8, 100 * 10**9)
    assert gqa.kv[0].bytes_per_token == 30 * 2 * 1 * 64 * 2  # 3 heads on 8 ranks: one each
    too_big = serving_memory(kv_cache_spec(LLAMA, "c: "), weights, 1, 4 * 10**9)
    assert too_big.kv_budget_bytes == 0 and too_big.kv[0].tokens == 0


@pytest.mark.parametrize(("tp", "fraction", "match"), [(0, 1.0, "--tp 0"), (1, 0.0, "--mem-fraction 0.0")])
def test_bad_settings(tp, fraction, match):
    with pytest.raises(KvqError, match=match):
        serving_memory(kv_cache_spec(LLAMA, "c: "), weight_bytes([], 30), tp, 10**9, fraction)
