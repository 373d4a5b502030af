"""What the KV cache holds per token and layer, and its bytes: the one source `kvq plan` and the runtime's
paged pool both size from, so their bytes per token are equal.

GQA (llama, glm4_moe): K and V, `num_key_value_heads * head_dim` each, in the KV dtype; tensor parallelism
splits the heads (a rank keeps at least one: vLLM and SGLang replicate KV heads when tp > heads).
MLA (deepseek_v3, kimi_k2, glm_moe_dsa): one latent row per token, `kv_lora_rank + qk_rope_head_dim`
(`kv_c` normalized ++ RoPE'd `k_pe`) in the KV dtype, no heads, the same row on every rank; FP8 rows use one
`k_scale` per layer (a scalar: no bytes per token). GLM-5's DSA indexer adds its own key cache,
`index_head_dim` per token and layer, kept in bf16 (fp32 in the runtime's fp32 reference mode).
Pure functions of the config fields and the KV dtype; imports kvq.errors, kvq.kv_cache_dtypes (the bytes
of each KV dtype) and kvq.checkpoint.model_config.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvq.checkpoint.model_config import positive_int
from kvq.errors import KvqError
from kvq.kv_cache_dtypes import BF16, KV_CACHE_DTYPE_BYTES

INDEXER_KEY_DTYPE = BF16
SLOT_STAMP_BYTES = 8  # per token and layer in kvq's checked pool (tags/full) only: its slot stamp


@dataclass(frozen=True)
class KvCacheSpec:
    """The cached tensors of one model, independent of dtype and parallelism."""

    kind: str  # "gqa" (K and V per KV head) or "mla" (one latent row)
    num_layers: int
    num_kv_heads: int  # GQA: KV heads; MLA: 1 (one latent row per token, no heads)
    head_dim: int  # GQA: width of K (= V) per head; MLA: the latent row, kv_lora_rank + qk_rope_head_dim
    kv_lora_rank: int = 0  # MLA: width of `kv_c`
    qk_rope_head_dim: int = 0  # MLA: width of `k_pe`
    index_head_dim: int = 0  # DSA indexer key width per token and layer; 0 without an indexer

    @property
    def is_mla(self) -> bool:
        return self.kind == "mla"

    @property
    def has_indexer(self) -> bool:
        return self.index_head_dim > 0

    def describe(self, tp: int = 1) -> str:
        """One line for humans: what a token holds per layer on one of `tp` ranks."""
        if self.is_mla:
            text = f"MLA latent kv_c {self.kv_lora_rank} + k_pe {self.qk_rope_head_dim}"
            if self.has_indexer:
                text += f", DSA indexer key {self.index_head_dim} ({INDEXER_KEY_DTYPE})"
            return f"{text} per layer x {self.num_layers} layers (the same on every rank)"
        heads = heads_per_rank(self, tp)
        return (
            f"K+V {heads} of {self.num_kv_heads} heads x {self.head_dim} per layer x {self.num_layers} layers"
        )


@dataclass(frozen=True)
class KvCacheBytes:
    """Bytes one token takes in the cache of one rank, summed over layers."""

    kv_cache_dtype: str
    kv: int  # K + V (GQA) or the latent row (MLA), in the KV dtype
    indexer: int  # DSA indexer keys (0 without an indexer)
    stamps: int = 0  # kvq's checked pool (--kv-integrity tags/full) only: int64 slot stamps, 8 B per layer

    @property
    def total(self) -> int:
        """What a server's KV pool (vLLM, SGLang) holds per token, and kvq's with --kv-integrity off."""
        return self.kv + self.indexer

    def kvq_total(self, is_checked: bool) -> int:
        """What kvq's KV pool holds per token (`kvq.runtime.kv_pool.page_bytes` / page_size): `total`, and
        the slot stamps in a checked pool."""
        return self.total + (self.stamps if is_checked else 0)


def kv_cache_spec(fields: dict, at: str) -> KvCacheSpec:
    """The KV cache of the language model whose config.json fields are `fields` (a model with
    `kv_lora_rank` caches the MLA latent). `at` starts error messages: `TextModel.at`, or "file: "."""
    num_layers = fields.get("num_hidden_layers")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise KvqError(
            f"{at}num_hidden_layers is {num_layers!r}: this model has no attention layers, so it has "
            "no KV cache; is config.json complete?"
        )
    why = "the KV cache is sized from it"
    if fields.get("kv_lora_rank"):
        rank, rope = (
            positive_int(fields, "kv_lora_rank", at, why),
            positive_int(fields, "qk_rope_head_dim", at, why),
        )
        index = positive_int(fields, "index_head_dim", at, why) if fields.get("index_topk") else 0
        return KvCacheSpec("mla", num_layers, 1, rank + rope, rank, rope, index)
    if not fields.get("num_attention_heads"):
        raise KvqError(
            f"{at}num_attention_heads is missing and there is no kv_lora_rank: kvq cannot tell what the "
            "KV cache of this model holds; is it a decoder-only transformer?"
        )
    num_heads = positive_int(fields, "num_attention_heads", at, why)
    head_dim = int(fields.get("head_dim") or positive_int(fields, "hidden_size", at, why) // num_heads)
    return KvCacheSpec("gqa", num_layers, int(fields.get("num_key_value_heads") or num_heads), head_dim)


def heads_per_rank(spec: KvCacheSpec, tp: int) -> int:
    """KV heads one of `tp` ranks caches: MLA 1 (replicated), GQA its share, at least one."""
    return 1 if spec.is_mla else max(1, spec.num_kv_heads // tp)


def kv_cache_bytes(spec: KvCacheSpec, kv_cache_dtype: str, tp: int = 1) -> KvCacheBytes:
    """Bytes per token on one of `tp` tensor-parallel ranks with `kv_cache_dtype` (bf16, fp8_e4m3, fp32)."""
    if kv_cache_dtype not in KV_CACHE_DTYPE_BYTES:
        raise KvqError(
            f"KV cache dtype {kv_cache_dtype!r} is not one kvq stores; "
            f"use one of {', '.join(KV_CACHE_DTYPE_BYTES)}"
        )
    if tp < 1:
        raise KvqError(f"tensor parallelism {tp}: must be at least 1")
    elem = KV_CACHE_DTYPE_BYTES[kv_cache_dtype]
    if spec.is_mla:
        kv = spec.num_layers * spec.head_dim * elem
    else:
        kv = spec.num_layers * 2 * heads_per_rank(spec, tp) * spec.head_dim * elem
    index_dtype = "fp32" if kv_cache_dtype == "fp32" else INDEXER_KEY_DTYPE
    indexer = spec.num_layers * spec.index_head_dim * KV_CACHE_DTYPE_BYTES[index_dtype]
    return KvCacheBytes(kv_cache_dtype, kv, indexer, spec.num_layers * SLOT_STAMP_BYTES)
