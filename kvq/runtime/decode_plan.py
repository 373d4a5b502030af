"""Decode steps on the native CPU path as one list of C calls, bound once per batch size: what CUDA graphs
are to vLLM's and SGLang's decode, for kvq's CPU kernels.

A Llama decoder layer makes ten kernel calls a token; the Python around them (each op's checks, output
allocations, views, argument lists: ~200 Python-level calls a layer) took ~35% of a SmolLM2 INT4 decode
step at batch 1 on one core. A `DecodePlan` holds buffers that outlive the step (the embeddings, the
rotary rows, slots, block tables, lengths, every layer's activations) and the list of every layer's calls
with their arguments bound to them; a step copies its inputs in and replays the list. The calls are the
eager forward's own, in its order, on the same values: the same bits (tested).

Where it runs (`model_blocker` and `step_blocker` say why not): Llama's decoder layers with its GQA
`Attention` (no q/k norms), one rank, bf16 activations on CPU, the C small ops on (the model's `CpuOps`:
its CPU path not torch), the KV pages bf16 or FP8 on the torch backend. A Linear that is not one C call
(torch's GEMM, FP8, W8A16, a bias) joins as `y.copy_(linear(x))`, a feed-forward other than Llama's
`MLP` (GLM-4.5's MoE) as `x.copy_(mlp(h))`: the same values, with that part's Python kept.
`EngineConfig.enforce_eager` turns plans off (vLLM's name).
Imports torch and kvq.runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from kvq.runtime.batch import ForwardBatch
from kvq.runtime.kernels.cpu.isa import Call
from kvq.runtime.kernels.cpu.ops import CpuOps
from kvq.runtime.layers.linear import Linear
from kvq.runtime.layers.norm import RMSNorm

if TYPE_CHECKING:
    from kvq.runtime.models.llama import Attention, DecoderLayer, LlamaForCausalLM

_KV_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def model_blocker(model: LlamaForCausalLM) -> str | None:
    """Why `model`'s layers cannot decode from a plan, or None when they can (`step_blocker` then says
    whether this step's pages and settings let them)."""
    from kvq.runtime.models.llama import MLP, Attention, DecoderLayer

    if model.tp.size != 1:
        return "tensor parallelism"
    if model.backend != "torch":
        return "the Triton kernels"
    if model.embed_tokens.dtype != torch.bfloat16 or model.embed_tokens.device.type != "cpu":
        return "not bf16 on CPU"
    norms = [model.norm]
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if type(layer) is not DecoderLayer or type(attn) is not Attention:
            return "a layer other than Llama's"
        if attn.q_norm is not None or (type(mlp) is MLP and mlp.is_partial) or attn.rotary.is_interleaved:
            return "q/k norms, a partial MLP or interleaved rotary"
        if attn.head_dim > 512 or attn.rotary.cos.dtype != torch.bfloat16:
            return "head_dim over 512 or rotary tables not bf16"
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
    if any(n.weight.dtype != torch.bfloat16 for n in norms):
        return "norm weights not bf16"
    return None


def describe_decode(model: LlamaForCausalLM, enforce_eager: bool) -> str:
    """One log line: whether CPU decode steps run from plans, and why not."""
    why = "--enforce-eager" if enforce_eager else model_blocker(model)
    if why is None and model.cpu_ops.level is None:
        why = "the C small ops are off"
    if why is None:
        return "CPU decode steps: plans (each layer's C calls bound once per batch size)"
    return f"CPU decode steps: eager ({why})"


def step_blocker(model: LlamaForCausalLM) -> str | None:
    """Why a plan cannot run now (`model_blocker(model)` None): the C ops off, or KV pages it cannot read."""
    if model.cpu_ops.level is None:
        return "the C small ops are off"
    for layer in model.layers:
        kv = _attention(layer).attn.kv
        if kv.backend != "torch" or kv.k_cache.device.type != "cpu" or kv.k_cache.dtype not in _KV_DTYPES:
            return "KV pages not bf16 / FP8 on CPU"
    return None


def _attention(layer: DecoderLayer) -> Attention:
    """A planned layer's attention: `model_blocker` admits Llama's `Attention` only."""
    return cast("Attention", layer.self_attn)


def _into(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, out: torch.Tensor) -> None:
    """A part without a single C call (a Linear, an MoE, torch's SiLU-and-mul) run as it is, into `out`."""
    out.copy_(fn(x))


def linear_call(linear: Linear, x: torch.Tensor, y: torch.Tensor) -> Call:
    """`y = linear(x)` as one C call where the Linear has one, else through the Linear itself."""
    return linear.call(x, y) or (_into, (linear, x, y))


def silu_mul_into(ops: CpuOps, gate_up: torch.Tensor, out: torch.Tensor) -> Call:
    """`MLP`'s SiLU-and-mul (`ops.silu_and_mul`) into `out`: its C call where it takes the C op."""
    if ops.silu_mul_applies(gate_up):
        return ops.silu_mul_call(gate_up, out)
    return _into, (ops.silu_and_mul, gate_up, out)


class DecodeBuffers:
    """The tensors a model's plans read and write, for up to `rows` sequences and `pages` block-table
    columns: step inputs, then activations (each layer's outputs overwrite the previous layer's)."""

    def __init__(self, model: LlamaForCausalLM, rows: int, pages: int) -> None:
        attn, config = _attention(model.layers[0]), model.config
        hidden, dim, bf16 = config.hidden_size, attn.head_dim, torch.bfloat16
        self.rows, self.pages = rows, pages
        self.cos = torch.empty(rows, attn.rotary.cos.shape[1], dtype=bf16)
        self.sin_signed = torch.empty_like(self.cos)
        self.slots = torch.empty(rows, dtype=torch.int64)
        self.slot_stamps = torch.empty(rows, dtype=torch.int64)  # the checked pool's, when it is on
        self.block_tables = torch.empty(rows, pages, dtype=torch.int32)
        self.seq_lens = torch.empty(rows, dtype=torch.int32)
        self.x = torch.empty(rows, hidden, dtype=bf16)  # the embeddings, then each MLP's output
        self.residuals = (torch.empty_like(self.x), torch.empty_like(self.x))  # taken in turns
        self.h = torch.empty_like(self.x)  # each norm's output
        self.qkv = torch.empty(rows, attn.q_size + 2 * attn.kv_size, dtype=bf16)
        self.qk = torch.empty(rows, attn.num_heads + attn.num_kv_heads, dim, dtype=bf16)  # rotated
        self.attn = torch.empty(rows, attn.num_heads, dim, dtype=bf16)
        self.o = torch.empty_like(self.x)
        self.gate_up = torch.empty(rows, 2 * config.intermediate_size, dtype=bf16)
        self.act = torch.empty(rows, config.intermediate_size, dtype=bf16)
        self.out = torch.empty_like(self.x)  # the final norm's


class DecodePlan:
    """Every call of a decode step of `num_rows` sequences over `buffers`, in the eager forward's order."""

    def __init__(
        self, model: LlamaForCausalLM, buffers: DecodeBuffers, num_rows: int, is_stamped: bool
    ) -> None:
        from kvq.runtime.models.llama import MLP

        self.model, self.buffers, self.num_rows, self.is_stamped = model, buffers, num_rows, is_stamped
        b, m, ops = buffers, num_rows, model.cpu_ops
        tables, lens, slots = b.block_tables[:m], b.seq_lens[:m], b.slots[:m]
        slot_stamps = b.slot_stamps[:m] if is_stamped else None  # --kv-integrity on: stamps with the K/V
        cos, sin_signed = b.cos[:m, None], b.sin_signed[:m, None]
        x, h, o, out = b.x[:m], b.h[:m], b.o[:m], b.out[:m]
        res = [r[:m] for r in b.residuals]
        calls: list[Call] = []
        residual: torch.Tensor | None = None  # the first layer's is its input

        def add_norm(norm: RMSNorm, into: torch.Tensor, value: torch.Tensor) -> None:
            nonlocal residual
            if residual is None:
                calls.append(ops.rms_norm_call(value, norm.weight, norm.eps, into))
                residual = value
                return
            total = res[0] if residual is not res[0] else res[1]
            calls.append(ops.rms_norm_call(value, norm.weight, norm.eps, into, residual, total))
            residual = total

        for layer in model.layers:
            attn, mlp = _attention(layer), layer.mlp
            heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
            qkv, qk, att = b.qkv[:m], b.qk[:m], b.attn[:m]
            kv = attn.attn.kv
            add_norm(layer.input_layernorm, h, x)
            calls.append(linear_call(attn.qkv_proj, h, qkv))
            unrotated = qkv[:, : attn.q_size + attn.kv_size].view(m, heads + kv_heads, dim)
            calls.append(ops.rotary_call(unrotated, cos, sin_signed, attn.rotary.rotary_dim, qk))
            v = qkv[:, attn.q_size + attn.kv_size :].view(m, kv_heads, dim)
            scales = kv.stacked_scales
            stamps = kv.stamps if is_stamped else None
            calls.append(
                ops.store_kv_call(
                    qk[:, heads:], v, kv.k_cache, kv.v_cache, scales, slots, stamps, slot_stamps
                )
            )
            q = qk[:, :heads]
            sm_scale = attn.attn.sm_scale
            calls.append(
                ops.decode_attention_call(att, q, kv.k_cache, kv.v_cache, scales, tables, lens, sm_scale)
            )
            calls.append(linear_call(attn.o_proj, att.view(m, attn.q_size), o))
            add_norm(layer.post_attention_layernorm, h, o)
            if type(mlp) is not MLP:  # an MoE: its own Python, into the buffer
                calls.append((_into, (mlp, h, x)))
                continue
            gate_up, act = b.gate_up[:m], b.act[:m]
            calls.append(linear_call(mlp.gate_up_proj, h, gate_up))
            calls.append(silu_mul_into(ops, gate_up, act))
            calls.append(linear_call(mlp.down_proj, act, x))
        add_norm(model.norm, out, x)
        self.calls, self.out = calls, out

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The step's final hidden states `[B, H]`: a view of the plan's buffer, valid until the next step."""
        b, m, rotary = self.buffers, self.num_rows, _attention(self.model.layers[0]).rotary
        torch.index_select(self.model.embed_tokens, 0, input_ids, out=b.x[:m])
        torch.index_select(rotary.cos, 0, positions, out=b.cos[:m])
        torch.index_select(rotary.sin_signed, 0, positions, out=b.sin_signed[:m])
        b.slots[:m].copy_(batch.slot_mapping)
        if batch.slot_stamps is not None:
            b.slot_stamps[:m].copy_(batch.slot_stamps)
        b.block_tables[:m, : batch.block_tables.shape[1]].copy_(batch.block_tables)
        b.seq_lens[:m].copy_(batch.context_lens)
        for fn, args in self.calls:
            fn(*args)
        return self.out


class DecodePlans:
    """A model's plans, one per batch size, made at a size's first step and kept; rebuilt when the KV
    pages or the thread count change, or a batch outgrows the buffers."""

    @classmethod
    def of(cls, model: LlamaForCausalLM, enforce_eager: bool) -> DecodePlans | None:
        """The model's plans, or None where it always decodes eagerly (`model_blocker`, enforce_eager)."""
        return None if enforce_eager or model_blocker(model) is not None else cls(model)

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.plans: dict[int, DecodePlan] = {}
        self.buffers: DecodeBuffers | None = None
        self.key: tuple | None = None
        self.blocker: str | None = None

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor | None:
        """The decode step's final hidden states from a plan, or None where the eager forward must run."""
        model = self.model
        # the key holds the first layer's cache object itself (compared by identity): the plans' pointers
        # stay valid while it lives, and the engine binds every layer's cache together
        key = (_attention(model.layers[0]).attn.kv, torch.get_num_threads())
        if key != self.key:
            self.key, self.plans, self.buffers = key, {}, None
            self.blocker = step_blocker(model)
        if self.blocker is not None or input_ids.device.type != "cpu":
            return None
        num_rows, pages = input_ids.shape[0], batch.block_tables.shape[1]
        b = self.buffers
        if b is None or num_rows > b.rows or pages > b.pages:  # table columns double: log(n) remakes
            rows = max(num_rows, b.rows if b else 1)
            self.buffers = DecodeBuffers(model, rows, max(pages, 2 * b.pages if b else 16))
            self.plans = {}
        is_stamped = batch.slot_stamps is not None  # --kv-integrity on: the stores stamp (it may switch)
        plan = self.plans.get(num_rows)
        if plan is None or plan.is_stamped != is_stamped:
            assert self.buffers is not None
            plan = self.plans[num_rows] = DecodePlan(model, self.buffers, num_rows, is_stamped)
        return plan.run(input_ids, positions, batch)
