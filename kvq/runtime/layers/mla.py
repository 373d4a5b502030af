"""Multi-head latent attention (DeepSeek-V3, Kimi K2, GLM-5) over the paged latent pool.

Read top to bottom: projections (q through the q_lora bottleneck, the latent `kv_c` and the shared
`k_pe` from `kv_a_proj_with_mqa`), what the pool stores (`kv_c ++ k_pe`, one row per token, no heads),
prefill in the expanded form (the latent read back from the pages, K_nope and V made by `kv_b_proj`,
causal SDPA: exact, and cheaper than the absorbed form when queries are many), decode in the absorbed
form (W_UK folded into the query, attention over the latent rows, W_UV after; as vLLM's and SGLang's MLA
backends). GLM-5 adds a DSA indexer (`dsa_indexer`): attention only over the tokens it selects.
`kv_b_proj` is kept dense in the activation dtype (`[H, nope + v, R]`), the one weight both forms use.
Softmax scale: qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 (as transformers).
Tensor parallelism (SGLang / vLLM without DP attention): the latent projections (`q_a_proj`,
`kv_a_proj_with_mqa`), the indexer and the latent cache are replicated on every rank; each rank holds its
heads' rows of `q_b_proj` and `kv_b_proj` and columns of `o_proj`, whose outputs the ranks sum.
Imports torch, transformers and kvq.runtime.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from kvq.runtime.batch import ForwardBatch
from kvq.runtime.distributed.shard import COLS, ROWS
from kvq.runtime.kernels.paged.latent_cache import PagedLatentCache
from kvq.runtime.layers.dsa_indexer import Indexer, Selection, SharedSelection
from kvq.runtime.layers.rotary import RotaryEmbedding
from kvq.runtime.loader import WeightLoader

CosSin = tuple[torch.Tensor, torch.Tensor]
LORA_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps


def softmax_scale(config: PretrainedConfig) -> float:
    """qk_head_dim^-0.5, with YaRN's mscale squared when the rope scales (DeepSeek-V3's yarn_get_mscale)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = config.rope_parameters or {}
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if params.get("rope_type", "default") != "default" and mscale_all_dim and params["factor"] > 1:
        mscale = 0.1 * mscale_all_dim * math.log(params["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


class MLAttention:
    def __init__(
        self,
        config: PretrainedConfig,
        prefix: str,
        loader: WeightLoader,
        rotary: RotaryEmbedding,
        indexer: Indexer | SharedSelection | None = None,
    ) -> None:
        hidden, bias = config.hidden_size, getattr(config, "attention_bias", False)
        heads, self.all_reduce = config.num_attention_heads, loader.tp.all_reduce_or_none
        start, stop = loader.tp.shard(heads, "config.json num_attention_heads")
        self.num_heads, self.q_lora_rank = stop - start, config.q_lora_rank
        self.kv_lora_rank, self.rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
        self.nope_dim, self.v_dim = config.qk_nope_head_dim, config.v_head_dim
        q_rows = heads * (self.nope_dim + self.rope_dim)  # all ranks' heads: the stored rows
        latent = (self.kv_lora_rank + self.rope_dim, hidden)
        self.q_lora_norm = None
        if self.q_lora_rank:  # q_a_proj and kv_a_proj_with_mqa read the same x: one projection
            self.qkv_a_proj = loader.linear(
                [f"{prefix}.q_a_proj", f"{prefix}.kv_a_proj_with_mqa"],
                [(self.q_lora_rank, hidden), latent],
                bias,
            )
            self.q_lora_norm = loader.rms_norm(
                f"{prefix}.q_a_layernorm.weight", self.q_lora_rank, LORA_NORM_EPS
            )
            self.q_b_proj = loader.linear([f"{prefix}.q_b_proj"], [(q_rows, self.q_lora_rank)], split=ROWS)
        else:
            self.qkv_a_proj = loader.linear(
                [f"{prefix}.q_proj", f"{prefix}.kv_a_proj_with_mqa"],
                [(q_rows, hidden), latent],
                bias,
                split=[ROWS, None],
            )
        self.kv_a_layernorm = loader.rms_norm(
            f"{prefix}.kv_a_layernorm.weight", self.kv_lora_rank, LORA_NORM_EPS
        )
        kv_b_rows = heads * (self.nope_dim + self.v_dim)
        kv_b = loader.stored_linear(f"{prefix}.kv_b_proj", (kv_b_rows, self.kv_lora_rank), split=ROWS)
        self.kv_b = kv_b.dense(loader.dtype).to(loader.device)  # [H * (nope + v), R]
        w_kv_b = self.kv_b.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_uk, self.w_uv = w_kv_b[:, : self.nope_dim], w_kv_b[:, self.nope_dim :]  # [H, nope | v, R]
        self.o_proj = loader.linear([f"{prefix}.o_proj"], [(hidden, heads * self.v_dim)], bias, split=COLS)
        # vLLM reads only k_scale for MLA; a v_scale (kvq calibrate writes one, equal) is read, unused
        self.kv_scales = {name: loader.optional(f"{prefix}.{name}") for name in ("k_scale", "v_scale")}
        self.rotary, self.indexer, self.scale = rotary, indexer, softmax_scale(config)
        unbound = torch.empty(0, 1, self.kv_lora_rank + self.rope_dim)  # no pages until `bind_kv`
        self.kv = PagedLatentCache.of(unbound, self.kv_lora_rank)  # the engine's KV pool hands them over

    def bind_kv(self, kv: PagedLatentCache) -> None:
        self.kv = kv

    def __call__(self, x: torch.Tensor, cos_sin: CosSin, batch: ForwardBatch) -> torch.Tensor:
        kv, num_tokens = self.kv, x.shape[0]
        if self.q_lora_rank:
            q_a, kv_a = self.qkv_a_proj(x).split([self.q_lora_rank, self.kv_lora_rank + self.rope_dim], -1)
            q_resid = self.q_lora_norm(q_a) if self.q_lora_norm is not None else q_a
            q = self.q_b_proj(q_resid)
        else:
            q_size = self.num_heads * (self.nope_dim + self.rope_dim)
            q, kv_a = self.qkv_a_proj(x).split([q_size, self.kv_lora_rank + self.rope_dim], -1)
            q_resid = q
        q_nope, q_pe = q.view(num_tokens, self.num_heads, -1).split([self.nope_dim, self.rope_dim], -1)
        kv_c, k_pe = self.kv_a_layernorm(kv_a[:, : self.kv_lora_rank]), kv_a[:, self.kv_lora_rank :]
        q_pe = self.rotary(q_pe, cos_sin)  # [T, H, rope]
        k_pe = self.rotary(k_pe[:, None], cos_sin)[:, 0]  # [T, rope]
        index_k = None if self.indexer is None else self.indexer.keys(x, cos_sin)
        kv.store(kv_c, k_pe, batch.slot_mapping, index_k, batch.slot_stamps)
        selection = (
            Selection() if self.indexer is None else self.indexer.select(x, q_resid, cos_sin, batch, kv)
        )
        if batch.is_prefill:
            out = self._prefill(q_nope, q_pe, batch, selection.prefill_masks)
        else:
            out = self._decode(q_nope, q_pe, batch, selection.token_indices)
        y = self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim))
        return y if self.all_reduce is None else self.all_reduce(y)

    def _prefill(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        batch: ForwardBatch,
        masks: list[torch.Tensor | None] | None,
    ) -> torch.Tensor:
        """Each sequence's new queries `[Lq, H, *]` over its whole context read back from the pages:
        K = [kv_c W_UK^T, k_pe], V = kv_c W_UV^T, causal (and DSA-selected: `masks`, per sequence `[Lq,
        L]`): `[T, H, v]` in q's dtype."""
        kv = self.kv
        dtype = torch.float32 if q_nope.device.type == "cpu" else q_nope.dtype  # as `paged.prefill`
        q = torch.cat([q_nope, q_pe], dim=-1).to(dtype)  # [T, H, nope + rope]
        out = torch.empty(*q.shape[:2], self.v_dim, dtype=q_nope.dtype, device=q.device)
        kv_b, start = self.kv_b.to(dtype), 0
        for b, (query_len, seq_len) in enumerate(zip(batch.query_lens, batch.context_lens_list, strict=True)):
            rows, _ = kv.read(batch.block_tables[b, : -(-seq_len // kv.page_size)].long(), seq_len)
            kv_c, k_pe = rows.to(dtype).split([self.kv_lora_rank, self.rope_dim], dim=-1)  # [L, R], [L, rope]
            k_nope, v = (
                (kv_c @ kv_b.T).view(seq_len, self.num_heads, -1).split([self.nope_dim, self.v_dim], -1)
            )
            k = torch.cat(
                [k_nope, k_pe[:, None].expand(-1, self.num_heads, -1)], dim=-1
            )  # [L, H, nope + rope]
            mask = None if masks is None else masks[b]
            if (
                mask is None and query_len < seq_len
            ):  # a cached prefix: query i sits at seq_len - query_len + i
                rows_at = torch.arange(query_len, device=q.device)[:, None] + (seq_len - query_len)
                mask = torch.arange(seq_len, device=q.device)[None, :] <= rows_at  # [Lq, L]
            o = F.scaled_dot_product_attention(
                q[start : start + query_len].transpose(0, 1),  # [H, Lq, nope + rope]
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
            )
            out[start : start + query_len] = o.transpose(0, 1)
            start += query_len
        return out

    def _decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        batch: ForwardBatch,
        token_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        """Absorbed: (q_nope W_UK ++ q_pe) over the latent rows (or DSA's `token_indices` `[B, K]`), then
        W_UV: `[B, H, v]`."""
        kv = self.kv
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [B, H, R]
        tables = batch.decode_tables(kv.backend)
        if token_indices is not None:
            tables = tables._replace(token_indices=token_indices)
        out_latent = kv.decode_attention(torch.cat([q_latent, q_pe], dim=-1), tables, self.scale)  # [B, H, R]
        return torch.bmm(out_latent.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, v]

    def tensors(self) -> list[torch.Tensor]:
        norms = [*self.kv_a_layernorm.tensors(), *(self.q_lora_norm.tensors() if self.q_lora_norm else [])]
        projections = [self.qkv_a_proj, self.o_proj, *([self.q_b_proj] if self.q_lora_rank else [])]
        indexer = [] if self.indexer is None else self.indexer.tensors()
        return [self.kv_b, *norms, *(t for p in projections for t in p.tensors()), *indexer]
