"""The small ops of a CPU decode step in C (`_cpu_ops`): RMSNorm (optionally after the residual add),
SiLU-and-mul, rotary, paged decode attention and the greedy sampler's argmax, each one call instead of
the 5-20 eager torch ops that cost more than the arithmetic at decode sizes. Same rounding steps as the
torch ops they replace (fp32 inside; see `_cpu_ops.c`).

`native_ops_apply(x)` says when they run: bf16 contiguous CPU tensors, the extension built, and
KVQ_CPU_ISA not `torch` (which keeps every CPU op in torch). Imports torch and kvq.runtime.kernels.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType

import torch

from kvq.runtime.kernels.cpu.isa import Call, cpu_isa_env, resolve_cpu_isa

_ext: ModuleType | None
try:
    _ext = importlib.import_module("kvq.runtime.kernels.cpu._ops")
except ImportError:  # built without a C compiler
    _ext = None


@cache
def _enabled(env_value: str | None) -> bool:
    """Whether the C ops run under this $KVQ_CPU_ISA value (cached: checked at every op)."""
    return _ext is not None and resolve_cpu_isa() != "torch"


VECTOR_LEVELS = {"scalar": 0, "avx2": 1}  # the C ops' vector level held to a $KVQ_CPU_ISA; else 2


@cache
def _vector_level(env_value: str | None) -> int:
    return VECTOR_LEVELS.get(resolve_cpu_isa(), 2)


def vector_level() -> int:
    """The highest vector level the C ops may use under $KVQ_CPU_ISA: 0 the build's baseline (`scalar`:
    plain arithmetic, FP8 pages widened in arithmetic), 1 AVX2 + F16C (`avx2`), else 2 (AVX-512
    where the CPU has it); the C side lowers it to what the CPU runs (`_ext.vector_level(wanted)`). Every
    level gives the same bits (tested against each other), so each can be run on one machine."""
    return _vector_level(cpu_isa_env())


LEVEL_NAMES = ("baseline", "AVX2", "AVX-512")


def describe_level() -> str:
    """The C ops' level that runs under $KVQ_CPU_ISA on this CPU, for the CPU path's log line: e.g.
    'AVX2 C ops', or 'torch' where they are off (`KVQ_CPU_ISA=torch`, or the extension is not built)."""
    if not _enabled(cpu_isa_env()):
        return "torch"
    assert _ext is not None
    return f"{LEVEL_NAMES[_ext.vector_level(vector_level())]} C ops"


def native_ops_enabled() -> bool:
    """Whether the C ops run at all: built, and $KVQ_CPU_ISA is not torch."""
    return _enabled(cpu_isa_env())


def native_ops_apply(x: torch.Tensor) -> bool:
    """True when the C ops run on `x`: bf16, contiguous, on CPU, built, and $KVQ_CPU_ISA is not torch."""
    return (
        x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.is_contiguous() and _enabled(cpu_isa_env())
    )


def rms_norm_native(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s) * weight, s) with s = x (+ residual, bf16) for bf16 x `[..., H]` (`native_ops_apply`),
    weight bf16 `[H]`; residual (optional) like x."""
    out = torch.empty_like(x)
    total = None if residual is None else torch.empty_like(x)
    fn, args = rms_norm_call(x, weight, eps, out, residual, total)
    fn(*args)
    return out, x if total is None else total


def rms_norm_call(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual: torch.Tensor | None = None,
    total: torch.Tensor | None = None,
) -> Call:
    """`rms_norm_native`'s C call into `out` (and `total` = x + residual, both or neither given), all
    contiguous."""
    assert _ext is not None and (residual is None) == (total is None)
    hidden = x.shape[-1]
    sums = (0, 0) if residual is None or total is None else (residual.data_ptr(), total.data_ptr())
    args = (x.data_ptr(), *sums, weight.data_ptr(), out.data_ptr(), x.numel() // hidden, hidden, eps)
    return _ext.rms_norm, (*args, torch.get_num_threads(), vector_level())


SILU_C_MAX_OUTPUTS = 4096  # above this many outputs torch's vectorized exp wins (C: dispatch-bound sizes)


def silu_mul_applies(gate_up: torch.Tensor) -> bool:
    """True when `silu_mul_native` is the faster route for bf16 gate_up `[M, 2I]`: `native_ops_apply`
    and M * I up to SILU_C_MAX_OUTPUTS (one decode token of a dense MLP; at [32, 2 x 1536] the C loop took
    69 us, torch's 42 us, on one Xeon core)."""
    return gate_up.numel() // 2 <= SILU_C_MAX_OUTPUTS and native_ops_apply(gate_up)


def silu_mul_native(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for bf16 gate_up `[M, 2I]` (gate first; `native_ops_apply`) -> `[M, I]`."""
    num_rows, width = gate_up.shape
    out = torch.empty((num_rows, width // 2), dtype=gate_up.dtype)
    fn, args = silu_mul_call(gate_up, out)
    fn(*args)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up `[M, 2I]` (gate first): the C op where `silu_mul_applies`, else torch's."""
    if silu_mul_applies(gate_up):
        return silu_mul_native(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_mul_call(gate_up: torch.Tensor, out: torch.Tensor) -> Call:
    """`silu_mul_native`'s C call into contiguous `out` `[M, I]`."""
    assert _ext is not None
    num_rows, width = gate_up.shape
    args = (gate_up.data_ptr(), out.data_ptr(), num_rows, width // 2, torch.get_num_threads(), vector_level())
    return _ext.silu_mul, args


def argmax_finite(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(`x.argmax(-1)`, `x.isfinite().all(-1)`) of fp32 or bf16 logits `[M, V]`: one pass in C (16 lanes at a
    time; no fp32 copy of bf16 logits: on a [32, 49152] batch the copy alone took ~0.4-2 ms) for contiguous
    CPU rows when the C ops run, else torch's own. Same answer either way: the first index of each row's
    maximum, or of its first NaN; a row is finite when it holds no NaN or +-inf."""
    if (
        x.dtype not in (torch.float32, torch.bfloat16)
        or x.dim() != 2
        or x.shape[-1] == 0
        or x.device.type != "cpu"
        or not x.is_contiguous()
        or not _enabled(cpu_isa_env())
    ):
        x = x.float()  # torch's CPU argmax of [32, 49152] bf16: 5.2 ms, the copy and fp32's: 0.4 + 2.1
        return x.argmax(dim=-1), x.isfinite().all(dim=-1)
    assert _ext is not None
    out, is_finite = torch.empty(x.shape[0], dtype=torch.int64), torch.empty(x.shape[0], dtype=torch.bool)
    rows, width, is_bf16 = x.shape[0], x.shape[1], x.dtype == torch.bfloat16
    outs, threads = (out.data_ptr(), is_finite.data_ptr()), torch.get_num_threads()
    _ext.argmax(x.data_ptr(), rows, width, is_bf16, *outs, threads, vector_level())
    return out, is_finite


def rotary_native(
    x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    """Rotate-half rotary of bf16 heads x `[T, H, D]` (heads packed, token rows any stride: a view of the
    qkv projection) with bf16 cos, sin_signed `[T, 1, R]` contiguous -> contiguous `[T, H, D]`, as
    `RotaryEmbedding.__call__` computes it in torch (`rotary_applies` says when)."""
    out = torch.empty(x.shape, dtype=x.dtype)
    fn, args = rotary_call(x, cos, sin_signed, rotary_dim, out)
    fn(*args)
    return out


def rotary_call(
    x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, rotary_dim: int, out: torch.Tensor
) -> Call:
    """`rotary_native`'s C call into contiguous `out` `[T, H, D]`."""
    assert _ext is not None
    num_tokens, num_heads, head_dim = x.shape
    args = (x.data_ptr(), x.stride(0), num_tokens, num_heads, head_dim, rotary_dim)
    return _ext.rotary, (*args, cos.data_ptr(), sin_signed.data_ptr(), out.data_ptr(), vector_level())


def rotary_applies(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> bool:
    """True when `rotary_native` runs: bf16 x `[T, H, D]` on CPU with packed heads, bf16 contiguous tables."""
    return (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and x.dim() == 3
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and cos.dtype == sin_signed.dtype == torch.bfloat16
        and cos.is_contiguous()
        and sin_signed.is_contiguous()
        and _enabled(cpu_isa_env())
    )


def store_applies(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """True when `store_kv_native` runs: bf16 k, v `[T, Hkv, D]` on CPU with packed heads (token rows any
    stride), bf16 or FP8 pages, an integer contiguous slot_mapping."""
    return (
        k.dtype == v.dtype == torch.bfloat16
        and k.device.type == "cpu"
        and k.stride(2) == v.stride(2) == 1
        and k.stride(1) == v.stride(1) == k.shape[2]
        and k_cache.dtype in _KV_DTYPES
        and slot_mapping.dtype in _INDEX_DTYPES
        and slot_mapping.is_contiguous()
        and _enabled(cpu_isa_env())
    )


def store_kv_native(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scales: torch.Tensor,
    slot_mapping: torch.Tensor,
    stamps: torch.Tensor | None = None,
    slot_stamps: torch.Tensor | None = None,
) -> None:
    """In place: k, v `[T, Hkv, D]` (`store_applies`) into their slots (negative: skipped); FP8 pages get
    `quantize_kv`'s bytes (x / scale, clamped, nearest even). scales fp32 contiguous `[2, Hkv]`. With
    `stamps` (the layer's int64 `[num_slots]`, any stride) and `slot_stamps` int64 contiguous `[T]`: each
    written slot's stamp too (`kernels.integrity.stamp_check.write_stamps`), in the same pass."""
    fn, args = store_kv_call(k, v, k_cache, v_cache, scales, slot_mapping, stamps, slot_stamps)
    fn(*args)


def store_kv_call(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scales: torch.Tensor,
    slot_mapping: torch.Tensor,
    stamps: torch.Tensor | None = None,
    slot_stamps: torch.Tensor | None = None,
) -> Call:
    """`store_kv_native`'s C call."""
    assert _ext is not None
    num_tokens, num_kv_heads, head_dim = k.shape
    is_stamped = stamps is not None and slot_stamps is not None
    if is_stamped:
        assert stamps is not None and slot_stamps is not None  # for mypy
        assert stamps.dtype == slot_stamps.dtype == torch.int64 and slot_stamps.is_contiguous()
        assert slot_stamps.shape == slot_mapping.shape
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
        vector_level(),
        stamps.data_ptr() if is_stamped else 0,  # type: ignore[union-attr]
        stamps.stride(0) if is_stamped else 0,  # type: ignore[union-attr]
        slot_stamps.data_ptr() if is_stamped else 0,  # type: ignore[union-attr]
    )


def stamps_check_applies(
    stamps: torch.Tensor, block_tables: torch.Tensor, expected_writers: torch.Tensor, read_lens: torch.Tensor
) -> bool:
    """True when `check_stamps_native` runs: CPU, contiguous int64 stamps, writers and lengths of the
    shapes `kernels.integrity.stamp_check` takes, block tables int32/int64 with unit inner stride."""
    return (
        stamps.device.type == "cpu"
        and stamps.dim() == 3
        and block_tables.dim() == 2
        and stamps.dtype == expected_writers.dtype == read_lens.dtype == torch.int64
        and block_tables.dtype in _INDEX_DTYPES
        and stamps.is_contiguous()
        and expected_writers.is_contiguous()
        and read_lens.is_contiguous()
        and (block_tables.stride(1) == 1 or block_tables.shape[1] <= 1)
        and tuple(expected_writers.shape) == tuple(block_tables.shape)
        and tuple(read_lens.shape) == (block_tables.shape[0],)
        and block_tables.device.type == expected_writers.device.type == read_lens.device.type == "cpu"
        and _enabled(cpu_isa_env())
    )


def check_stamps_native(
    stamps: torch.Tensor, block_tables: torch.Tensor, expected_writers: torch.Tensor, read_lens: torch.Tensor
) -> torch.Tensor:
    """`kernels.integrity.stamp_check.check_stamps_reference` as one C call (`stamps_check_applies`)."""
    assert _ext is not None
    num_rows, width = block_tables.shape
    out = torch.empty(num_rows, dtype=torch.int64)
    _ext.check_stamps(
        stamps.data_ptr(),
        stamps.shape[0],
        stamps.shape[1],
        stamps.shape[2],
        block_tables.data_ptr(),
        block_tables.stride(0),
        int(block_tables.dtype == torch.int64),
        expected_writers.data_ptr(),
        read_lens.data_ptr(),
        num_rows,
        width,
        out.data_ptr(),
    )
    return out


def native_attention_applies(
    q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> bool:
    """True when `decode_attention_native` runs this call: bf16 queries (`native_ops_apply`, or rows of
    packed heads: q split from the rotary's output), bf16 or FP8 pages, integer tables with rows of
    stride 1, head_dim <= 512."""
    return (
        (native_ops_apply(q) or (native_ops_apply(q[0]) and q.stride(0) >= q[0].numel()))
        and k_cache.dtype in _KV_DTYPES
        and block_tables.dtype in _INDEX_DTYPES
        and seq_lens.dtype in _INDEX_DTYPES
        and block_tables.stride(-1) == 1
        and seq_lens.is_contiguous()
        and q.shape[-1] <= 512
    )


_KV_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
_INDEX_DTYPES = (torch.int32, torch.int64)


def decode_attention_native(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scales: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Paged decode attention (`paged/attention.py`'s contract) in C, reading bf16 or FP8 pages directly
    (FP8: bytes to fp32 in AVX-512 or F16C registers or, under KVQ_CPU_ISA=scalar, in arithmetic, the
    per-head scales on the query and the output; no bf16 copy of the pages), the (sequence, KV head)
    pairs over torch.get_num_threads() threads of the W4A16 kernel's pool. q bf16 `[B, Hq, D]`
    (`native_attention_applies`), scales fp32 contiguous `[2, Hkv]` (K, V) -> bf16 `[B, Hq, D]`."""
    out = torch.empty(q.shape, dtype=q.dtype)
    fn, args = decode_attention_call(q, k_cache, v_cache, scales, block_tables, seq_lens, sm_scale, out)
    fn(*args)
    return out


def decode_attention_call(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scales: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
) -> Call:
    """`decode_attention_native`'s C call into contiguous `out` `[B, Hq, D]`."""
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
        vector_level(),
    )
