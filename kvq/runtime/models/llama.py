"""Llama (SmolLM2 and other `model_type: llama` checkpoints) over paged KV and stored-form weights.

Read top to bottom: attention, MLP, decoder layer, model. The other families reuse all of it and swap
parts through the model's `make_*` hooks: glm4_moe the MLP, the MLA models also the rotary, the attention
and the KV layout.
Weights come from a `WeightLoader` by their checkpoint names. Under tensor parallelism (`loader.tp`) each
rank holds its heads and its share of the MLP (column-parallel q/k/v and gate/up, row-parallel o and down,
one all-reduce after each) and its share of the vocabulary (embedding and lm_head; logits gathered).
Imports torch and kvq.runtime.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from transformers import PretrainedConfig

from kvq.runtime.batch import ForwardBatch
from kvq.runtime.config import LM_HEAD_GROUP_SIZE, lm_head_mode
from kvq.runtime.distributed.group import TpGroup
from kvq.runtime.distributed.shard import COLS, ROWS
from kvq.runtime.kernels import PagedKVCache
from kvq.runtime.layers.attention import PagedAttention
from kvq.runtime.layers.linear import DenseLinear, Linear, int4_copy, int8_copy
from kvq.runtime.layers.rotary import RotaryEmbedding
from kvq.runtime.loader import WeightLoader

CosSin = tuple[torch.Tensor, torch.Tensor]


def local_count(tp: TpGroup, count: int, what: str) -> int:
    """This rank's share of `count` heads (a `KvqError` naming `what` when they do not split)."""
    start, stop = tp.shard(count, what)
    return stop - start


def local_heads_scale(scale: torch.Tensor | None, tp: TpGroup, num_heads: int) -> torch.Tensor | None:
    """A KV scale for this rank's heads: a per-head one sliced, a per-tensor one as it is."""
    if scale is None or scale.numel() != num_heads or tp.size == 1:
        return scale
    start, stop = tp.shard(num_heads, "k_scale / v_scale heads")
    return scale.reshape(-1)[start:stop]


class FeedForward(Protocol):
    """What a decoder layer's MLP slot holds: Llama's MLP, GLM's MoE."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def tensors(self) -> list[torch.Tensor]: ...


class SelfAttention(Protocol):
    """What a decoder layer's attention slot holds: GQA `Attention`, MLA `MLAttention`. The engine reads
    its checkpoint scales and hands it its cache object over the KV pool (`kv_layout`)."""

    kv_scales: dict[str, torch.Tensor | None]

    def __call__(self, x: torch.Tensor, cos_sin: CosSin, batch: ForwardBatch) -> torch.Tensor: ...

    def bind_kv(self, kv: Any) -> None: ...

    def tensors(self) -> list[torch.Tensor]: ...


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Attention:
    """GQA self-attention: fused q/k/v projection (+ bias), rotary, paged attention, output projection
    (this rank's query and KV heads under tensor parallelism)."""

    def __init__(
        self, config: PretrainedConfig, prefix: str, loader: WeightLoader, rotary: RotaryEmbedding
    ) -> None:
        hidden, d, tp = config.hidden_size, head_dim_of(config), loader.tp
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_heads = local_count(tp, heads, "config.json num_attention_heads")
        self.num_kv_heads = local_count(tp, kv_heads, "config.json num_key_value_heads")
        self.head_dim, self.all_reduce = d, tp.all_reduce_or_none
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.qkv_proj = loader.linear(
            [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"],
            [(heads * d, hidden), (kv_heads * d, hidden), (kv_heads * d, hidden)],
            bias=getattr(config, "attention_bias", False),
            split=ROWS,
        )
        self.o_proj = loader.linear([f"{prefix}.o_proj"], [(hidden, heads * d)], split=COLS)
        self.q_norm = self.k_norm = None
        if getattr(config, "use_qk_norm", False):  # GLM-4.5 option: RMSNorm per head before rotary
            self.q_norm = loader.rms_norm(f"{prefix}.q_norm.weight", d, config.rms_norm_eps)
            self.k_norm = loader.rms_norm(f"{prefix}.k_norm.weight", d, config.rms_norm_eps)
        self.kv_scales = {
            name: local_heads_scale(loader.optional(f"{prefix}.{name}"), tp, kv_heads)
            for name in ("k_scale", "v_scale")
        }
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, loader.cpu_ops)

    def bind_kv(self, kv: PagedKVCache) -> None:
        """The layer's cache object over the engine's KV pool (`GqaLayout`)."""
        self.attn.bind(kv)

    def __call__(self, x: torch.Tensor, cos_sin: CosSin, batch: ForwardBatch) -> torch.Tensor:
        num_tokens, num_qk_heads = x.shape[0], self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(
            num_tokens, num_qk_heads, self.head_dim
        )  # [T, Hq+Hkv, D]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat(
                [self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1
            )
        q, k = self.rotary(qk, cos_sin).split([self.num_heads, self.num_kv_heads], dim=1)
        out = self.o_proj(self.attn(q, k, v, batch).reshape(num_tokens, self.q_size))  # attn: [T, Hq, D]
        return out if self.all_reduce is None else self.all_reduce(out)

    def tensors(self) -> list[torch.Tensor]:
        norms = [t for n in (self.q_norm, self.k_norm) if n is not None for t in n.tensors()]
        return [*self.qkv_proj.tensors(), *self.o_proj.tensors(), *norms]


class MLP:
    """SiLU-gated MLP: down(SiLU(gate(x)) * up(x)), gate and up fused into one projection. Under tensor
    parallelism a rank holds its share of the intermediate dimension and sums the ranks' outputs, unless
    `is_partial` (an MoE's shared experts: the MoE sums once for both)."""

    def __init__(
        self, prefix: str, loader: WeightLoader, hidden: int, intermediate: int, is_partial: bool = False
    ) -> None:
        self.gate_up_proj = loader.linear(
            [f"{prefix}.gate_proj", f"{prefix}.up_proj"],
            [(intermediate, hidden), (intermediate, hidden)],
            split=ROWS,
        )
        self.down_proj = loader.linear([f"{prefix}.down_proj"], [(hidden, intermediate)], split=COLS)
        self.is_partial, self.ops = is_partial, loader.cpu_ops.on(loader.device)  # None: torch's SiLU
        self.all_reduce = None if is_partial else loader.tp.all_reduce_or_none

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is None:  # off CPU or with the C ops off
            gate, up = gate_up.chunk(2, dim=-1)
            y = self.down_proj(torch.nn.functional.silu(gate) * up)
        else:
            y = self.down_proj(self.ops.silu_and_mul(gate_up))
        return y if self.all_reduce is None else self.all_reduce(y)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.gate_up_proj.tensors(), *self.down_proj.tensors()]


class DecoderLayer:
    def __init__(
        self,
        config: PretrainedConfig,
        prefix: str,
        loader: WeightLoader,
        attention: SelfAttention,
        mlp: FeedForward,
    ) -> None:
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = loader.rms_norm(f"{prefix}.input_layernorm.weight", hidden, eps)
        self.self_attn = attention
        self.post_attention_layernorm = loader.rms_norm(
            f"{prefix}.post_attention_layernorm.weight", hidden, eps
        )
        self.mlp = mlp

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: CosSin, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream it adds to) from the previous layer's pair (the first
        layer: the embeddings, None). The layer's output is their sum, which the next norm takes in
        `add_norm` (as vLLM's layers do): one fused C call instead of a torch add per layer."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_norm(x, residual)
        h, residual = self.post_attention_layernorm.add_norm(self.self_attn(h, cos_sin, batch), residual)
        return self.mlp(h), residual

    def tensors(self) -> list[torch.Tensor]:
        return [
            *self.input_layernorm.tensors(),
            *self.self_attn.tensors(),
            *self.post_attention_layernorm.tensors(),
            *self.mlp.tensors(),
        ]


class LlamaForCausalLM:
    """Embedding, decoder layers, final norm, lm_head (tied to the embedding when the config says so; an
    INT8 / INT4 runtime copy of a dense one with `lm_head_weights="int8"` / `"int4"`)."""

    def __init__(self, config: PretrainedConfig, loader: WeightLoader) -> None:
        self.config, self.tp = config, loader.tp
        self.head_dim = head_dim_of(config)
        hidden, vocab = config.hidden_size, config.vocab_size
        self.max_positions = config.max_position_embeddings
        self.vocab_start, _ = self.tp.shard(vocab, "config.json vocab_size")
        # [V / tp, H]: this rank's rows of the vocabulary
        self.embed_tokens = loader.tensor("model.embed_tokens.weight", (vocab, hidden), split=ROWS)
        self.rotary = self.make_rotary(loader)
        self.layers: list[DecoderLayer] = []  # in order: a layer may refer to the ones before it
        for i in range(config.num_hidden_layers):
            prefix = f"model.layers.{i}"
            attention = self.make_attention(f"{prefix}.self_attn", i, loader)
            self.layers.append(
                DecoderLayer(config, prefix, loader, attention, self.make_mlp(f"{prefix}.mlp", i, loader))
            )
        self.norm = loader.rms_norm("model.norm.weight", hidden, config.rms_norm_eps)
        # the kernels it was built for (its decode plans call the CPU ones; its KV pool takes both)
        self.cpu_ops, self.backend = loader.cpu_ops, loader.backend
        if config.tie_word_embeddings:
            loader.optional("lm_head.weight")  # some tied checkpoints store a copy; the embedding is used
            self.lm_head: Linear = DenseLinear(self.embed_tokens, None, loader.cpu_ops)
        else:
            self.lm_head = loader.linear(["lm_head"], [(vocab, hidden)], split=ROWS)
        self.lm_head_mode = lm_head_mode(loader.config, config.tie_word_embeddings)
        int8_activations = loader.config.int4_compute == "w4a8"
        if isinstance(self.lm_head, DenseLinear) and self.lm_head_mode == "int4":
            self.lm_head = int4_copy(
                self.lm_head.weight, LM_HEAD_GROUP_SIZE, loader.cpu_ops, int8_activations
            )
        elif isinstance(self.lm_head, DenseLinear) and self.lm_head_mode == "int8":
            dense = self.lm_head if config.tie_word_embeddings else None  # resident anyway: the embedding
            self.lm_head = int8_copy(self.lm_head.weight, loader.cpu_ops, int8_activations, dense)

    def make_rotary(self, loader: WeightLoader) -> RotaryEmbedding:
        return RotaryEmbedding(
            self.config, self.head_dim, self.max_positions, loader.dtype, loader.device, loader.cpu_ops
        )

    def make_attention(self, prefix: str, layer_idx: int, loader: WeightLoader) -> SelfAttention:
        return Attention(self.config, prefix, loader, self.rotary)

    def make_mlp(self, prefix: str, layer_idx: int, loader: WeightLoader) -> FeedForward:
        return MLP(prefix, loader, self.config.hidden_size, self.config.intermediate_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids, positions `[T]` -> final hidden states `[T, H]` (a CPU decode step runs from the
        runner's `DecodePlan` instead where one runs: the same values)."""
        x, residual = self.embed(input_ids), None  # [T, H]
        cos_sin = self.rotary.at(positions)
        for layer in self.layers:
            x, residual = layer(x, residual, cos_sin, batch)
        return self.norm(x) if residual is None else self.norm.add_norm(x, residual)[0]

    def embed(self, input_ids: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
        """`[T]` -> `[T, H]` from `table` (default: the model's `embed_tokens`; an MTP layer may have its
        own); under tensor parallelism each rank looks up its own vocabulary rows (zeros for the others')
        and the ranks sum."""
        table = self.embed_tokens if table is None else table
        if self.tp.size == 1:
            return table[input_ids]
        local = input_ids - self.vocab_start
        is_here = (local >= 0) & (local < table.shape[0])
        x = table[local.clamp(0, table.shape[0] - 1)] * is_here[:, None]
        return self.tp.all_reduce(x)

    def compute_logits(self, hidden: torch.Tensor, lm_head: Linear | None = None) -> torch.Tensor:
        """`[B, H]` -> logits `[B, V]` in the lm_head's dtype (every rank's vocabulary share, gathered): bf16
        in the fast paths, whose fp32 copy alone took 0.4-2.5 ms of a 30 ms SmolLM2 step at 32 rows on a
        CPU (the sampler reads bf16 as it is; bf16 -> fp32 is exact), fp32 in reference mode. `lm_head`:
        another head over the same vocabulary (an MTP layer's own)."""
        logits = (self.lm_head if lm_head is None else lm_head)(hidden)
        return logits if self.tp.size == 1 else self.tp.all_gather_last(logits)

    def attention_layers(self) -> list[SelfAttention]:
        return [layer.self_attn for layer in self.layers]

    def tensors(self) -> list[torch.Tensor]:
        """Every resident weight tensor, each once (the tied lm_head shares the embedding)."""
        seen: dict[int, torch.Tensor] = {}
        for t in (
            self.embed_tokens,
            *[t for layer in self.layers for t in layer.tensors()],
            *self.norm.tensors(),
            *self.lm_head.tensors(),
        ):
            seen.setdefault(id(t), t)
        return list(seen.values())
