"""GLM-5's DSA indexer (DeepSeek Sparse Attention): which `index_topk` earlier tokens each query attends to.

As transformers' GlmMoeDsaIndexer: keys `k_norm(wk(x))` (one `index_head_dim` row per token, interleaved
RoPE on the first `qk_rope_head_dim` channels) live in the layer's index key pages beside the latent;
queries `wq_b(q_resid)` per index head, RoPE'd alike; a token's score for query t is
sum_h w[t, h] * relu(q[t, h] . k * index_head_dim^-0.5) with w = weights_proj(x) (fp32) * heads^-0.5,
over the causal context; the top `min(index_topk, context)` are the selection. Each query's scores
form the row transformers' generate forms for it (the prompt's queries: rows as long as the prompt;
later ones: as long as their context), whatever kvq's schedule, so `torch.topk` breaks exact ties
(relu's zeros) as it does there and a recompute after preemption chooses what the first run chose. A
context within `index_topk` selects everything: attention is dense, and no scores are computed.
`"shared"` layers reuse the previous full layer's selection (`SharedSelection`).
Imports torch and kvq.runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from kvq.runtime.batch import ForwardBatch
from kvq.runtime.kernels.paged.latent_cache import PagedLatentCache
from kvq.runtime.layers.norm import LayerNorm
from kvq.runtime.layers.rotary import RotaryEmbedding
from kvq.runtime.loader import WeightLoader

CosSin = tuple[torch.Tensor, torch.Tensor]
K_NORM_EPS = 1e-6  # transformers' nn.LayerNorm(index_head_dim, eps=1e-6)


@dataclass
class Selection:
    """The step's sparse selection, None where attention is dense. Prefill: per sequence a bool mask
    `[query_len, seq_len]` (causal and selected); decode: positions `[B, index_topk]` int64, -1 = none."""

    prefill_masks: list[torch.Tensor | None] | None = None
    token_indices: torch.Tensor | None = None


class Indexer:
    """A DSA layer's own indexer (`indexer_types[i] == "full"`)."""

    def __init__(self, config: PretrainedConfig, prefix: str, loader: WeightLoader, rotary: RotaryEmbedding):
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.index_topk, hidden = config.index_topk, config.hidden_size
        self.wq_b = loader.linear([f"{prefix}.wq_b"], [(self.num_heads * self.head_dim, config.q_lora_rank)])
        self.wk = loader.linear([f"{prefix}.wk"], [(self.head_dim, hidden)])
        self.k_norm = LayerNorm(
            loader.tensor(f"{prefix}.k_norm.weight", (self.head_dim,)),
            loader.tensor(f"{prefix}.k_norm.bias", (self.head_dim,)),
            K_NORM_EPS,
        )
        # transformers keeps weights_proj in fp32 (`_keep_in_fp32_modules`) and computes it in fp32
        self.weights_proj = loader.tensor(
            f"{prefix}.weights_proj.weight", (self.num_heads, hidden), torch.float32
        )
        self.rotary, self.softmax_scale = rotary, self.head_dim**-0.5
        self.last = Selection()  # this step's, for the shared layers after this one

    def keys(self, x: torch.Tensor, cos_sin: CosSin) -> torch.Tensor:
        """Index keys `[T, index_head_dim]` of the step's tokens, as the pages store them."""
        return self.rotary(self.k_norm(self.wk(x))[:, None], cos_sin)[:, 0]

    def select(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        cos_sin: CosSin,
        batch: ForwardBatch,
        kv: PagedLatentCache,
    ) -> Selection:
        """The step's selection (its keys are in the pages already)."""
        if batch.max_context_len <= self.index_topk:
            self.last = Selection()
            return self.last
        num_tokens = x.shape[0]
        q = self.rotary(self.wq_b(q_resid).view(num_tokens, self.num_heads, self.head_dim), cos_sin).float()
        weights = F.linear(x.float(), self.weights_proj) * self.num_heads**-0.5  # [T, Hi]
        if batch.is_prefill:
            self.last = Selection(prefill_masks=self._prefill_masks(q, weights, batch, kv))
        else:
            self.last = Selection(token_indices=self._decode_indices(q, weights, batch, kv))
        return self.last

    def tensors(self) -> list[torch.Tensor]:
        return [*self.wq_b.tensors(), *self.wk.tensors(), *self.k_norm.tensors(), self.weights_proj]

    def _scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q `[n, Hi, Di]`, weights `[n, Hi]`, keys `[L, Di]` -> fp32 scores `[n, L]` (transformers' ops)."""
        scores = F.relu(torch.matmul(q, keys.float().T) * self.softmax_scale)  # [n, Hi, L]
        return torch.matmul(weights[:, None, :], scores)[:, 0]

    def _prefill_masks(
        self, q: torch.Tensor, weights: torch.Tensor, batch: ForwardBatch, kv: PagedLatentCache
    ) -> list[torch.Tensor | None]:
        masks: list[torch.Tensor | None] = []
        start, page_size = 0, kv.page_size
        for b, (query_len, seq_len) in enumerate(zip(batch.query_lens, batch.context_lens_list, strict=True)):
            end = start + query_len
            if seq_len <= self.index_topk:
                masks.append(None)
            else:
                _, keys = kv.read(batch.block_tables[b, : -(-seq_len // page_size)].long(), seq_len)
                assert keys is not None, "a DSA layer's cache has index pages"
                positions = torch.arange(seq_len - query_len, seq_len, device=q.device)
                scores = self._scores(q[start:end], weights[start:end], keys)  # [Lq, L]
                masks.append(self._choose(scores, positions, batch.prompt_lens[b]))
            start = end
        return masks

    def _choose(self, scores: torch.Tensor, positions: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """The causal and selected mask `[Lq, L]` of query rows at `positions`. Each row is scored as
        transformers' generate forms it, whatever the schedule (a prefix hit, a recompute after
        preemption): a prompt position within a row as long as the prompt, -inf past the query; a later
        one within its own context. torch.topk breaks exact ties by the row it is given."""
        seq_len = scores.shape[1]
        is_causal = torch.arange(seq_len, device=scores.device)[None, :] <= positions[:, None]  # [Lq, L]
        scores = scores.masked_fill(~is_causal, float("-inf"))
        selected = torch.zeros_like(is_causal)
        in_prompt = (positions < prompt_len).nonzero().flatten()
        if in_prompt.numel():
            rows = scores[in_prompt, :prompt_len]
            chosen = rows.topk(min(self.index_topk, prompt_len), dim=-1).indices
            selected[in_prompt] = selected[in_prompt].scatter(1, chosen, True)
        for r in (positions >= prompt_len).nonzero().flatten().tolist():
            length = int(positions[r]) + 1
            chosen = scores[r, :length].topk(min(self.index_topk, length)).indices
            selected[r, chosen] = True
        return selected & is_causal

    def _decode_indices(
        self, q: torch.Tensor, weights: torch.Tensor, batch: ForwardBatch, kv: PagedLatentCache
    ) -> torch.Tensor:
        """Positions `[B, index_topk]` (-1 padded): sequences of one context length scored together."""
        assert kv.index_rows is not None, "a DSA layer's cache has index pages"
        num_seqs, page_size = q.shape[0], kv.page_size
        indices = torch.full((num_seqs, self.index_topk), -1, dtype=torch.int64, device=q.device)
        lengths = batch.context_lens_list
        for seq_len in sorted(set(lengths)):
            rows = torch.tensor([b for b, n in enumerate(lengths) if n == seq_len], device=q.device)
            if seq_len <= self.index_topk:
                indices[rows, :seq_len] = torch.arange(seq_len, device=q.device)
                continue
            positions = torch.arange(seq_len, device=q.device)
            pages = batch.block_tables.index_select(0, rows).long()[:, positions // page_size]  # [n, L]
            keys = kv.index_rows[(pages * page_size + positions % page_size).flatten()]
            keys = keys.view(rows.numel(), seq_len, -1).float()
            scores = F.relu(torch.matmul(q[rows], keys.transpose(1, 2)) * self.softmax_scale)  # [n, Hi, L]
            scores = torch.matmul(weights[rows][:, None, :], scores)[:, 0]  # [n, L]
            indices[rows] = scores.topk(self.index_topk, dim=-1).indices
        return indices


class SharedSelection:
    """A `"shared"` DSA layer: the selection of the last full indexer before it, this same step."""

    def __init__(self, source: Indexer) -> None:
        self.source = source

    def keys(self, x: torch.Tensor, cos_sin: CosSin) -> None:
        return None

    def select(self, *inputs: object) -> Selection:
        """The source's selection of this step (a shared layer reads none of the full layer's inputs)."""
        return self.source.last

    def tensors(self) -> list[torch.Tensor]:
        return []
