"""Per-GPU weight memory and the KV-cache tokens that fit beside it, as a tensor-parallel server places them.

Parallelism: `tp` ranks without DP attention and without expert parallelism (vLLM's and SGLang's default).
Replicated on every rank: norms, the MoE router (`mlp.gate`, `e_score_correction_bias`), MLA's down
projections `q_a_proj` and `kv_a_proj_with_mqa` (vLLM `fused_qkv_a_proj` with `disable_tp=True`, SGLang
`ReplicatedLinear`), the DSA indexer, KV scales, INT4 `weight_shape` records (two integers each rank
keeps whole). Split 1/tp: routed and shared experts (each expert's
intermediate dimension), the other attention projections (heads), the dense MLP, embeddings and lm_head
(vocabulary). MTP / NextN layers (index >= num_hidden_layers) are counted apart: servers load them only
for speculative decoding. The KV cache per token comes from `kvq.checkpoint.kv_cache_spec` (the MLA latent
is replicated per rank, GQA heads are split), which kvq's own pool also holds with --kv-integrity off;
`kvq_checked_bytes_per_token` adds its checked pool's slot stamps (tags/full, 8 bytes per layer).
Memory: `mem_fraction` is SGLang's `--mem-fraction-static`: weights + KV pool <= mem_fraction x GPU
memory, so the pool gets `mem_fraction x gpu_mem - weights`. SGLang measures free memory after loading
the weights, so whatever else is allocated by then (CUDA context, NCCL and all-reduce buffers, the torch
allocator's reserve) also comes out of that budget; activations and CUDA graphs live in the remaining
1 - mem_fraction. kvq counts none of that: its token count is an upper bound of what the server reports.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from kvq.checkpoint.kv_cache_spec import KvCacheSpec, kv_cache_bytes
from kvq.checkpoint.module_kind import module_kind
from kvq.errors import KvqError
from kvq.kv_cache_dtypes import BF16, FP8_E4M3

KV_CACHE_DTYPES = (BF16, FP8_E4M3)  # what `kvq plan` compares
_REPLICATED_KINDS = {"norms", "router", "kv_scales"}
_REPLICATED = re.compile(r"\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.|\.indexer\.|\.weight_shape$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
PARALLELISM = (
    "tensor parallel, no DP attention, no expert parallelism (vLLM / SGLang default): replicated on every "
    "GPU: norms, routers, MLA q_a_proj / kv_a_proj_with_mqa, DSA indexer, KV scales, INT4 weight_shape, the "
    "MLA latent cache; "
    "split 1/tp: experts, other attention projections, dense MLP, embeddings, lm_head, GQA KV heads"
)


@dataclass(frozen=True)
class WeightBytes:
    """A checkpoint's tensor bytes by how a tensor-parallel server places them."""

    replicated: int  # on every rank
    split: int  # divided over the ranks
    mtp: int  # MTP / NextN layers: loaded only for speculative decoding, not counted per GPU

    def per_gpu(self, tp: int) -> int:
        return self.replicated + math.ceil(self.split / tp)


@dataclass(frozen=True)
class KvFit:
    """The KV pool of one KV-cache dtype on one GPU."""

    kv_cache_dtype: str
    bytes_per_token: int  # summed over layers, on one GPU
    kv_bytes_per_token: int  # K+V or the MLA latent
    indexer_bytes_per_token: int  # DSA indexer keys (bf16)
    tokens: int
    kvq_checked_bytes_per_token: int  # kvq's pool with --kv-integrity tags/full: + slot stamps (8 B/layer)


@dataclass(frozen=True)
class ServingMemory:
    tp: int
    gpu_mem_bytes: int
    mem_fraction: float
    weights: WeightBytes
    weight_bytes_per_gpu: int
    kv_budget_bytes: int  # mem_fraction x gpu_mem - weights (0 if the weights do not fit)
    kv_layout: str
    kv: tuple[KvFit, ...]
    parallelism: str = PARALLELISM

    def to_json(self) -> dict:
        return asdict(self)


def weight_bytes(tensors: Iterable[tuple[str, int]], num_layers: int) -> WeightBytes:
    """Sum (name, bytes) pairs as replicated, split or MTP; `num_layers` is config.json's
    num_hidden_layers (decoder layers at or past it are MTP layers)."""
    replicated = split = mtp = 0
    for name, nbytes in tensors:
        layer = _LAYER.search(name)
        if layer is not None and int(layer[1]) >= num_layers:
            mtp += nbytes
        elif module_kind(name) in _REPLICATED_KINDS or _REPLICATED.search(name):
            replicated += nbytes
        else:
            split += nbytes
    return WeightBytes(replicated, split, mtp)


def serving_memory(
    spec: KvCacheSpec, weights: WeightBytes, tp: int, gpu_mem_bytes: int, mem_fraction: float = 1.0
) -> ServingMemory:
    """Weights per GPU and the KV tokens of each of `KV_CACHE_DTYPES` that fit in the rest of the budget."""
    if tp < 1:
        raise KvqError(f"--tp {tp}: must be at least 1")
    if not 0.0 < mem_fraction <= 1.0:
        raise KvqError(
            f"--mem-fraction {mem_fraction}: must be in (0, 1], e.g. 0.88 (SGLang's default range)"
        )
    per_gpu = weights.per_gpu(tp)
    budget = max(0, math.floor(mem_fraction * gpu_mem_bytes) - per_gpu)
    fits = []
    for dtype in KV_CACHE_DTYPES:
        per_token = kv_cache_bytes(spec, dtype, tp)
        fits.append(
            KvFit(
                dtype,
                per_token.total,
                per_token.kv,
                per_token.indexer,
                budget // per_token.total,
                kvq_checked_bytes_per_token=per_token.kvq_total(is_checked=True),
            )
        )
    return ServingMemory(
        tp, gpu_mem_bytes, mem_fraction, weights, per_gpu, budget, spec.describe(tp), tuple(fits)
    )
