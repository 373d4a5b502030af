"""What the KV cache holds per token and layer: GQA K+V split over ranks, the MLA latent replicated, the DSA
indexer key in bf16; bytes for each KV dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvq.checkpoint.kv_cache_spec import KvCacheSpec, kv_cache_bytes, kv_cache_spec
from kvq.checkpoint.model_config import text_model
from kvq.errors import KvqError

DATA = Path(__file__).parents[1] / "compress" / "data"
LLAMA = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}


def _published(name: str) -> KvCacheSpec:
    model = text_model(json.loads((DATA / name).read_text()), name)
    return kv_cache_spec(model.fields, model.at)


def test_gqa_caches_k_and_v_per_head_split_over_ranks() -> None:
    spec = kv_cache_spec(LLAMA, "c: ")
    assert (spec.kind, spec.num_kv_heads, spec.head_dim) == ("gqa", 3, 64)
    assert kv_cache_bytes(spec, "bf16").total == 30 * 2 * 3 * 64 * 2
    assert kv_cache_bytes(spec, "fp8_e4m3", tp=8).kv == 30 * 2 * 1 * 64  # 3 heads on 8 ranks: one each
    assert kv_cache_bytes(spec, "fp32").total == 30 * 2 * 3 * 64 * 4
    assert "K+V 1 of 3 heads x 64" in spec.describe(tp=8)


def test_kimi_k26_caches_one_latent_row_on_every_rank() -> None:
    spec = _published("kimi-k2.6-config.json")
    assert (spec.kind, spec.num_layers, spec.head_dim, spec.index_head_dim) == ("mla", 61, 576, 0)
    bf16, fp8 = kv_cache_bytes(spec, "bf16", tp=8), kv_cache_bytes(spec, "fp8_e4m3", tp=8)
    assert bf16.total == 61 * 576 * 2 == 70272  # 68.6 KiB, as published for Kimi K2.6
    assert fp8.total * 2 == bf16.total and kv_cache_bytes(spec, "bf16", tp=1) == bf16


def test_glm5_indexer_key_is_counted_apart_in_bf16() -> None:
    spec = _published("glm-5.1-config.json")
    fp8 = kv_cache_bytes(spec, "fp8_e4m3", tp=8)
    assert (fp8.kv, fp8.indexer, fp8.total) == (78 * 576, 78 * 128 * 2, 78 * (576 + 256))
    assert kv_cache_bytes(spec, "bf16").indexer == fp8.indexer
    assert kv_cache_bytes(spec, "fp32").indexer == 78 * 128 * 4
    assert "DSA indexer key 128 (bf16)" in spec.describe()


@pytest.mark.parametrize(
    ("fields", "dtype", "message"),
    [
        ({**LLAMA, "num_hidden_layers": 0}, "bf16", "num_hidden_layers is 0: this model has no attention"),
        ({"num_hidden_layers": 2}, "bf16", "num_attention_heads is missing"),
        ({"num_hidden_layers": 2, "kv_lora_rank": 512}, "bf16", "qk_rope_head_dim is None"),
        (LLAMA, "fp8", "KV cache dtype 'fp8' is not one kvq stores; use one of bf16, fp8_e4m3, fp32"),
    ],
)
def test_bad_input(fields: dict, dtype: str, message: str) -> None:
    with pytest.raises(KvqError, match=message):
        kv_cache_bytes(kv_cache_spec(fields, "config.json: "), dtype)
