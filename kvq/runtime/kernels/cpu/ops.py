"""The small ops of a CPU decode step in C (`_ops`): RMSNorm (optionally after the residual add),
SiLU-and-mul, rotary, the paged KV store and decode attention, each one call instead of the 5-20 eager
torch ops that cost more than the arithmetic at decode sizes; and the greedy sampler's argmax, which is
exact. Same rounding steps as the torch ops they replace (fp32 inside; see `_ops.c`). The integrity
kernels' C calls are `kernels/integrity/cpu_calls.py`'s.

`CpuOps` is the CPU kernels as an engine chose them, once, at load (`CpuOps.choose`: the `cpu_isa`
setting, else $KVQ_CPU_ISA, else the best this CPU runs): the W4A16 path and the C ops' vector level, or
the C ops off (`torch`, or the extension not built). Layers and KV caches hold the engine's `CpuOps` and
call its methods; nothing on the decode path asks the environment again. The argmax runs in C wherever
the extension is built, whatever the path: its answer does not depend on it.
Imports torch and kvq.runtime.kernels.cpu.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from kvq.runtime.kernels.cpu.isa import Call, resolve_cpu_isa
from kvq.runtime.kernels.cpu.linear import DenseScratch, dot_of

_ext: ModuleType | None
try:
    _ext = importlib.import_module("kvq.runtime.kernels.cpu._ops")
except ImportError:  # built without a C compiler
    _ext = None

VECTOR_LEVELS = {"scalar": 0, "avx2": 1}  # the C ops' vector level held to a CPU path; else WIDEST
WIDEST = 2  # AVX-512 where the CPU has it: the C side lowers a level to what the CPU runs
LEVEL_NAMES = ("baseline", "AVX2", "AVX-512")
SILU_C_MAX_OUTPUTS = 4096  # above this many outputs torch's vectorized exp wins (C: dispatch-bound sizes)
_KV_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class CpuOps:
    """The CPU kernels chosen once (`choose`): `isa`, the W4A16 path (`cpu.isa`), and `level`, the C small
    ops' vector level (0 the build's baseline, 1 AVX2 + F16C, 2 AVX-512 where the CPU has it; every level
    gives the same bits, so each can be run on one machine), or None where they are off and every op runs
    in torch. `dot`: how avx512bf16 and amx multiply bf16 activations (`cpu.isa.bf16_dot`: $KVQ_CPU_DOT,
    else by vendor), None on the other paths. `scratch`: the bf16 buffer that `NativeW4A16`'s batches
    decompress weights into, one per engine."""

    isa: str
    level: int | None
    dot: str | None = None
    scratch: DenseScratch = field(default_factory=DenseScratch, compare=False, repr=False)

    @classmethod
    def choose(cls, cpu_isa: str | None = None) -> CpuOps:
        """The kernels for `cpu_isa` (None: $KVQ_CPU_ISA, else auto; see `resolve_cpu_isa`, which raises
        `KvqError` for a path this CPU or build cannot run)."""
        isa = resolve_cpu_isa(cpu_isa)
        level = None if _ext is None or isa == "torch" else VECTOR_LEVELS.get(isa, WIDEST)
        return cls(isa, level, dot_of(isa))

    def on(self, device: torch.device) -> CpuOps | None:
        """These kernels for a layer whose tensors live on `device`, decided once at load: self where the C
        small ops run (a CPU device, the ops on), else None (the layer runs torch's ops, never asking)."""
        return self if device.type == "cpu" and self.level is not None else None

    def describe_level(self) -> str:
        """The C ops' level on this CPU, for the CPU path's log line: e.g. 'AVX2 C ops', or 'torch'."""
        if self.level is None:
            return "torch"
        assert _ext is not None
        return f"{LEVEL_NAMES[_ext.vector_level(self.level)]} C ops"

    def applies(self, x: torch.Tensor) -> bool:
        """True when the C ops run on `x`: they are on, and x is bf16, contiguous, on CPU."""
        return (
            self.level is not None
            and x.dtype == torch.bfloat16
            and x.device.type == "cpu"
            and x.is_contiguous()
        )

    # -- RMSNorm ----------------------------------------------------------------------------------------
    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(s) * weight, s) with s = x (+ residual, bf16) for bf16 x `[..., H]` (`applies`),
        weight bf16 `[H]`; residual (optional) like x."""
        out = torch.empty_like(x)
        total = None if residual is None else torch.empty_like(x)
        fn, bound = self.rms_norm_call(x, weight, eps, out, residual, total)
        fn(*bound)
        return out, x if total is None else total

    def rms_norm_call(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out: torch.Tensor,
        residual: torch.Tensor | None = None,
        total: torch.Tensor | None = None,
    ) -> Call:
        """`rms_norm`'s C call into `out` (and `total` = x + residual, both or neither given), all
        contiguous."""
        assert _ext is not None and (residual is None) == (total is None)
        hidden = x.shape[-1]
        sums = (0, 0) if residual is None or total is None else (residual.data_ptr(), total.data_ptr())
        args = (x.data_ptr(), *sums, weight.data_ptr(), out.data_ptr(), x.numel() // hidden, hidden, eps)
        return _ext.rms_norm, (*args, torch.get_num_threads(), self.level)

    # -- SiLU-and-mul -----------------------------------------------------------------------------------
    def silu_mul_applies(self, gate_up: torch.Tensor) -> bool:
        """True when the C op is the faster route for bf16 gate_up `[M, 2I]`: `applies` and M * I up to
        SILU_C_MAX_OUTPUTS (one decode token of a dense MLP; at [32, 2 x 1536] the C loop took 69 us,
        torch's 42 us, on one Xeon core)."""
        return gate_up.numel() // 2 <= SILU_C_MAX_OUTPUTS and self.applies(gate_up)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up `[M, 2I]` (gate first): the C op where `silu_mul_applies`, else
        torch's."""
        if not self.silu_mul_applies(gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.nn.functional.silu(gate) * up
        out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype)
        fn, bound = self.silu_mul_call(gate_up, out)
        fn(*bound)
        return out

    def silu_mul_call(self, gate_up: torch.Tensor, out: torch.Tensor) -> Call:
        """The C SiLU-and-mul of bf16 gate_up `[M, 2I]` into contiguous `out` `[M, I]`."""
        assert _ext is not None
        num_rows, width = gate_up.shape
        threads = torch.get_num_threads()
        return _ext.silu_mul, (gate_up.data_ptr(), out.data_ptr(), num_rows, width // 2, threads, self.level)

    # -- rotary -----------------------------------------------------------------------------------------
    def rotary_applies(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> bool:
        """True when `rotary` runs: bf16 x `[T, H, D]` on CPU with packed heads, bf16 contiguous tables."""
        return (
            self.level is not None
            and x.dtype == torch.bfloat16
            and x.device.type == "cpu"
            and x.dim() == 3
            and x.stride(2) == 1
            and x.stride(1) == x.shape[2]
            and cos.dtype == sin_signed.dtype == torch.bfloat16
            and cos.is_contiguous()
            and sin_signed.is_contiguous()
        )

    def rotary(
        self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, rotary_dim: int
    ) -> torch.Tensor:
        """Rotate-half rotary of bf16 heads x `[T, H, D]` (heads packed, token rows any stride: a view of
        the qkv projection) with bf16 cos, sin_signed `[T, 1, R]` contiguous -> contiguous `[T, H, D]`, as
        `RotaryEmbedding.__call__` computes it in torch (`rotary_applies` says when)."""
        out = torch.empty(x.shape, dtype=x.dtype)
        fn, bound = self.rotary_call(x, cos, sin_signed, rotary_dim, out)
        fn(*bound)
        return out

    def rotary_call(
        self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, rotary_dim: int, out: torch.Tensor
    ) -> Call:
        """`rotary`'s C call into contiguous `out` `[T, H, D]`."""
        assert _ext is not None
        num_tokens, num_heads, head_dim = x.shape
        args = (x.data_ptr(), x.stride(0), num_tokens, num_heads, head_dim, rotary_dim)
        return _ext.rotary, (*args, cos.data_ptr(), sin_signed.data_ptr(), out.data_ptr(), self.level)

    # -- the paged KV store -----------------------------------------------------------------------------
    def store_applies(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> bool:
        """True when `store_kv` runs: bf16 k, v `[T, Hkv, D]` on CPU with packed heads (token rows any
        stride), bf16 or FP8 pages, an integer contiguous slot_mapping."""
        return (
            self.level is not None
            and k.dtype == v.dtype == torch.bfloat16
            and k.device.type == "cpu"
            and k.stride(2) == v.stride(2) == 1
            and k.stride(1) == v.stride(1) == k.shape[2]
            and k_cache.dtype in _KV_DTYPES
            and slot_mapping.dtype in _INDEX_DTYPES
            and slot_mapping.is_contiguous()
        )

    def store_kv(self, *args: Any) -> None:
        """`store_kv_call(*args)` run: in place, k, v `[T, Hkv, D]` (`store_applies`) into their slots."""
        fn, bound = self.store_kv_call(*args)
        fn(*bound)

    def store_kv_call(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scales: torch.Tensor,
        slot_mapping: torch.Tensor,
        stamps: torch.Tensor | None = None,
        slot_stamps: torch.Tensor | None = None,
    ) -> Call:
        """The C store of k, v `[T, Hkv, D]` (`store_applies`) into their slots (negative: skipped); FP8 pages
        get `quantize_kv`'s bytes (x / scale, clamped, nearest even). scales fp32 contiguous `[2, Hkv]`.
        With `stamps` (the layer's int64 `[num_slots]`, any stride) and `slot_stamps` int64 contiguous
        `[T]`: each written slot's stamp too (`kernels.integrity.stamp_check.write_stamps`), in the same
        pass."""
        assert _ext is not None
        num_tokens, num_kv_heads, head_dim = k.shape
        stamp_args = (0, 0, 0)
        if stamps is not None and slot_stamps is not None:
            assert stamps.dtype == slot_stamps.dtype == torch.int64 and slot_stamps.is_contiguous()
            assert slot_stamps.shape == slot_mapping.shape
            stamp_args = (stamps.data_ptr(), stamps.stride(0), slot_stamps.data_ptr())
        return _ext.store_kv, (
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            num_tokens,
            num_kv_heads,
            head_dim,
            k_cache.data_ptr(),
            k_cache.stride()[:3],
            v_cache.data_ptr(),
            v_cache.stride()[:3],
            int(k_cache.dtype == torch.float8_e4m3fn),
            scales.data_ptr(),
            slot_mapping.data_ptr(),
            int(slot_mapping.dtype == torch.int64),
            k_cache.shape[1],
            self.level,
            *stamp_args,
        )

    # -- paged decode attention -------------------------------------------------------------------------
    def attention_applies(
        self, q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
    ) -> bool:
        """True when `decode_attention` runs this call: bf16 queries (`applies`, or rows of packed heads:
        q split from the rotary's output), bf16 or FP8 pages, integer tables with rows of stride 1,
        head_dim <= 512."""
        return (
            (self.applies(q) or (self.applies(q[0]) and q.stride(0) >= q[0].numel()))
            and k_cache.dtype in _KV_DTYPES
            and block_tables.dtype in _INDEX_DTYPES
            and seq_lens.dtype in _INDEX_DTYPES
            and block_tables.stride(-1) == 1
            and seq_lens.is_contiguous()
            and q.shape[-1] <= 512
        )

    def decode_attention(self, q: torch.Tensor, *args: Any) -> torch.Tensor:
        """`decode_attention_call(out, q, *args)` run into a new `out` like q: bf16 `[B, Hq, D]`."""
        out = torch.empty(q.shape, dtype=q.dtype)
        fn, bound = self.decode_attention_call(out, q, *args)
        fn(*bound)
        return out

    def decode_attention_call(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scales: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        sm_scale: float,
    ) -> Call:
        """Paged decode attention (`paged/attention.py`'s contract) in C into contiguous `out`, reading bf16
        or FP8 pages directly (FP8: bytes to fp32 in AVX-512 or F16C registers or, at level 0, in
        arithmetic, the per-head scales on the query and the output; no bf16 copy of the pages), the
        (sequence, KV head) pairs over torch.get_num_threads() threads of the W4A16 kernel's pool. q bf16
        `[B, Hq, D]` (`attention_applies`), scales fp32 contiguous `[2, Hkv]` (K, V), out bf16 like q."""
        assert _ext is not None
        num_seqs, num_heads, head_dim = q.shape
        _, page_size, num_kv_heads, _ = k_cache.shape
        return _ext.decode_attention, (
            q.data_ptr(),
            q.stride(0) if num_seqs > 1 else num_heads * head_dim,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            int(k_cache.dtype == torch.float8_e4m3fn),
            k_cache.stride()[:3],
            v_cache.stride()[:3],
            scales.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            int(block_tables.dtype == torch.int64),
            seq_lens.data_ptr(),
            int(seq_lens.dtype == torch.int64),
            out.data_ptr(),
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            page_size,
            sm_scale,
            torch.get_num_threads(),
            self.level,
        )


def argmax_finite(x: torch.Tensor, level: int = WIDEST) -> tuple[torch.Tensor, torch.Tensor]:
    """(`x.argmax(-1)`, `x.isfinite().all(-1)`) of fp32 or bf16 logits `[M, V]`: one pass in C (16 lanes at a
    time; no fp32 copy of bf16 logits: on a [32, 49152] batch the copy alone took ~0.4-2 ms) for contiguous
    CPU rows where the extension is built, else torch's own. Same answer either way (and at every vector
    `level`): the first index of each row's maximum, or of its first NaN; a row is finite when it holds no
    NaN or +-inf."""
    if (
        _ext is None
        or x.dtype not in (torch.float32, torch.bfloat16)
        or x.dim() != 2
        or x.shape[-1] == 0
        or x.device.type != "cpu"
        or not x.is_contiguous()
    ):
        x = x.float()  # torch's CPU argmax of [32, 49152] bf16: 5.2 ms, the copy and fp32's: 0.4 + 2.1
        return x.argmax(dim=-1), x.isfinite().all(dim=-1)
    out, is_finite = torch.empty(x.shape[0], dtype=torch.int64), torch.empty(x.shape[0], dtype=torch.bool)
    rows, width, is_bf16 = x.shape[0], x.shape[1], x.dtype == torch.bfloat16
    outs, threads = (out.data_ptr(), is_finite.data_ptr()), torch.get_num_threads()
    _ext.argmax(x.data_ptr(), rows, width, is_bf16, *outs, threads, level)
    return out, is_finite
