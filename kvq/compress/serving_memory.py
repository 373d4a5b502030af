"""Per-GPU weight memory and how many KV-cache tokens fit beside it, from config.json alone.

KV bytes per token: MLA models (DeepSeek-V3, Kimi-K2, GLM-5) cache the compressed latent, `kv_lora_rank +
qk_rope_head_dim` values per layer, replicated on every tensor-parallel rank; GLM-5's DSA indexer adds its
key, `index_head_dim` values per layer. GQA models cache K and V, `2 * num_key_value_heads * head_dim`
per layer, split across ranks (at least one head per rank). Weights are split evenly over `tp` ranks.
Not counted: activations, CUDA graphs, the runtime's own reserve; treat the token count as an upper bound.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kvq.errors import KvqError
from kvq.kv_cache_dtypes import KV_CACHE_DTYPE_BYTES, resolve_kv_cache_dtype


@dataclass(frozen=True)
class ServingMemory:
    tp: int
    gpu_mem_bytes: int
    kv_cache_dtype: str
    weight_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    kv_layout: str
    kv_tokens: int

    def to_json(self) -> dict:
        return asdict(self)


def kv_bytes_per_token(config: dict, kv_cache_dtype: str, tp: int) -> tuple[int, str]:
    """(KV-cache bytes per token on one of `tp` GPUs, a description of the layout); `kv_cache_dtype` is
    bf16 or fp8_e4m3."""
    text = config.get("text_config") or config
    elem = KV_CACHE_DTYPE_BYTES[kv_cache_dtype]
    layers = int(text["num_hidden_layers"])
    if text.get("kv_lora_rank"):
        per_layer = int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim", 0))
        layout = f"MLA latent {text['kv_lora_rank']}+{text.get('qk_rope_head_dim', 0)}"
        if text.get("index_head_dim") and text.get("index_topk"):
            per_layer += int(text["index_head_dim"])
            layout += f" + DSA indexer key {text['index_head_dim']}"
        return layers * per_layer * elem, f"{layout} per layer x {layers} layers (replicated per GPU)"
    heads = int(text.get("num_key_value_heads") or text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
    heads_per_gpu = max(1, heads // tp)
    return (
        layers * 2 * heads_per_gpu * head_dim * elem,
        f"K+V {heads_per_gpu} of {heads} heads x {head_dim} per layer x {layers} layers",
    )


def serving_memory(
    config: dict, weight_bytes: int, tp: int, gpu_mem_bytes: int, kv_cache_dtype: str
) -> ServingMemory:
    """What `tp` GPUs of `gpu_mem_bytes` hold; `kv_cache_dtype` "auto" is fp8_e4m3 when config.json has a
    `kv_cache_scheme` (calibrated scales), else bf16, as the runtime picks it."""
    if tp < 1:
        raise KvqError(f"--tp {tp}: must be at least 1")
    has_scales = bool((config.get("quantization_config") or {}).get("kv_cache_scheme"))
    kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, has_scales)
    per_gpu = math.ceil(weight_bytes / tp)
    kv_per_token, layout = kv_bytes_per_token(config, kv_cache_dtype, tp)
    tokens = max(0, gpu_mem_bytes - per_gpu) // kv_per_token
    return ServingMemory(tp, gpu_mem_bytes, kv_cache_dtype, per_gpu, kv_per_token, layout, tokens)
