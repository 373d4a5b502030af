"""The MTP (NextN) layer of GLM-5.x and DeepSeek-V3/R1 checkpoints, the draft model of `--speculative mtp`.

As vLLM's DeepSeekMultiTokenPredictorLayer: at position i it reads the token at i + 1 and the model's final
hidden state at i (after the final norm), `h = eh_proj(cat(enorm(embed(token)), hnorm(hidden)))` (the
embedding zeroed at position 0), runs one full decoder layer (MLA over the layer's own latent pages in the
KV pool, GLM-5's DSA indexer where stored, MoE where a router is stored) and predicts the token at i + 2
through `shared_head.norm` and `shared_head.head`, or the model's own embedding and lm_head where the
checkpoint stores none (GLM-5 shares both). Only the first MTP layer is run (the released checkpoints
have one). Imports torch and kvq.runtime.
"""

from __future__ import annotations

import torch

from kvq.checkpoint.config_sizes import num_mtp_layers
from kvq.checkpoint.model_config import TextModel
from kvq.errors import KvqError
from kvq.runtime.batch import ForwardBatch
from kvq.runtime.distributed.shard import ROWS
from kvq.runtime.layers.dsa_indexer import Indexer
from kvq.runtime.layers.linear import Linear
from kvq.runtime.layers.mla import MLAttention
from kvq.runtime.loader import WeightLoader
from kvq.runtime.models.glm4_moe import MoE
from kvq.runtime.models.llama import MLP, DecoderLayer, FeedForward, LlamaForCausalLM, SelfAttention

MTP_ARCHITECTURES = ("deepseek_v3", "glm_moe_dsa")


def check_mtp(model: TextModel, where: str) -> int:
    """The index of the first MTP layer of `model`; a `KvqError` saying why `--speculative mtp` cannot run."""
    if model.architecture not in MTP_ARCHITECTURES:
        raise KvqError(
            f"{where}: --speculative mtp drafts with MTP (NextN) layers, which kvq runs for "
            f"{', '.join(MTP_ARCHITECTURES)}; this is a {model.model_type} model: drop --speculative"
        )
    if num_mtp_layers(model.fields) < 1:
        raise KvqError(
            f"{where}: --speculative mtp needs MTP layers but {model.at}config.json has "
            f"num_nextn_predict_layers {model.fields.get('num_nextn_predict_layers')!r}: use a checkpoint "
            "that ships its MTP layer (GLM-5.x, DeepSeek-V3/R1) or drop --speculative"
        )
    return int(model.fields["num_hidden_layers"])


class MultiTokenPredictor:
    def __init__(self, model: LlamaForCausalLM, loader: WeightLoader, layer_idx: int) -> None:
        config, prefix = model.config, f"model.layers.{layer_idx}"
        hidden, vocab, eps = config.hidden_size, config.vocab_size, config.rms_norm_eps
        self.model = model  # its embedding, rotary and lm_head where the MTP layer shares them
        self.embed_tokens = model.embed_tokens
        if loader.has(f"{prefix}.embed_tokens.weight"):  # DeepSeek-V3 stores a copy; GLM-5 shares the model's
            self.embed_tokens = loader.tensor(f"{prefix}.embed_tokens.weight", (vocab, hidden), split=ROWS)
        self.enorm = loader.rms_norm(f"{prefix}.enorm.weight", hidden, eps)
        self.hnorm = loader.rms_norm(f"{prefix}.hnorm.weight", hidden, eps)
        self.eh_proj = loader.linear([f"{prefix}.eh_proj"], [(hidden, 2 * hidden)])
        self.layer = DecoderLayer(
            config, prefix, loader, self._attention(prefix, loader), self._mlp(prefix, loader)
        )
        self.shared_head_norm = loader.rms_norm(f"{prefix}.shared_head.norm.weight", hidden, eps)
        self.head: Linear | None = None  # None: the model's lm_head
        head = f"{prefix}.shared_head.head"
        if loader.has(f"{head}.weight") or loader.has(f"{head}.weight_packed"):
            self.head = loader.linear([head], [(vocab, hidden)], split=ROWS)

    def _attention(self, prefix: str, loader: WeightLoader) -> SelfAttention:
        model, attn = self.model, f"{prefix}.self_attn"
        indexer = None
        if loader.has(f"{attn}.indexer.k_norm.weight"):  # GLM-5: the MTP layer has a full DSA indexer
            indexer = Indexer(model.config, f"{attn}.indexer", loader, model.rotary)
        return MLAttention(model.config, attn, loader, model.rotary, indexer)

    def _mlp(self, prefix: str, loader: WeightLoader) -> FeedForward:
        config = self.model.config
        if loader.has(f"{prefix}.mlp.gate.weight"):  # a router: the layer is MoE (as the released ones)
            return MoE(config, f"{prefix}.mlp", loader)
        return MLP(f"{prefix}.mlp", loader, config.hidden_size, config.intermediate_size)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """Tokens at i + 1 and positions i `[T]`, the model's (or this layer's) hidden states at i `[T, H]`
        -> this layer's hidden states `[T, H]` (before `shared_head.norm`), which also feed its next draft."""
        embeds = self.model.embed(input_ids, self.embed_tokens)
        embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)  # vLLM: position 0 has no previous token
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous.to(embeds.dtype))], dim=-1))
        out, residual = self.layer(x, None, self.model.rotary.at(positions), batch)
        return out + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[B, H]` -> draft logits `[B, V]` (the lm_head's dtype)."""
        return self.model.compute_logits(self.shared_head_norm(hidden), self.head)

    def attention_layers(self) -> list[SelfAttention]:
        return [self.layer.self_attn]

    def tensors(self) -> list[torch.Tensor]:
        """The weights this layer holds of its own (not the model's shared embedding and head)."""
        own = [
            *self.enorm.tensors(),
            *self.hnorm.tensors(),
            *self.eh_proj.tensors(),
            *self.layer.tensors(),
            *self.shared_head_norm.tensors(),
            *(self.head.tensors() if self.head is not None else []),
        ]
        if self.embed_tokens is not self.model.embed_tokens:
            own.append(self.embed_tokens)
        return own
