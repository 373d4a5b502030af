"""The native CPU W4A16 kernel: which path runs (`KVQ_CPU_ISA`) and the launchers over the C extension
(the W8A16 and dense BF16 entries' too, `gemm_w8`, `gemm_dense`).

`_w4a16_cpu` (built with the package, optional) reads the compressed-tensors layout as loaded (see
`w4a16.py`) with AMX (avx512bf16, but batches of at least `AMX_FROM_ROWS` bf16 rows through AMX tiles
over compressed-tensors' bf16(q * scale)), AVX-512 BF16 (AVX-512, but bf16 activations through
vdpbf16ps, or as fixed point through VNNI's vpdpbusd), AVX-512, AVX2 + FMA or scalar C loops
chosen at run time. On avx512bf16, batches of at least `dense_from_rows` bf16 rows (prefill, and on
the vdpbf16ps GEMM from 32 rows; amx: `AMX_DENSE_FROM_ROWS`) instead decompress the weight to bf16
(`dequantize`, in chunks of rows) and run torch's BF16 GEMM (oneDNN). Without the extension, or with
KVQ_CPU_ISA=torch, the CPU path is `aten._weight_int4pack_mm_for_cpu`. Imports torch and kvq.errors.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from kvq.errors import KvqError

CPU_ISA_ENV = "KVQ_CPU_ISA"
CPU_DOT_ENV = "KVQ_CPU_DOT"  # how avx512bf16 multiplies bf16 activations: vnni or bf16 (unset: by CPU vendor)
CPU_ISA_CHOICES = ("auto", "amx", "avx512bf16", "avx512", "avx2", "scalar", "torch")
NATIVE_ISAS = ("amx", "avx512bf16", "avx512", "avx2", "scalar")
AUTO_ISAS = NATIVE_ISAS[:4]  # auto's order of preference ("scalar" is the reference, never auto's)
BF16_DOT_ISAS = ("amx", "avx512bf16")  # the paths whose bf16 activations go as $KVQ_CPU_DOT says (`bf16_dot`)
_ISA_CODES = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512bf16": 3, "amx": 4}
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NATIVE_DTYPES = tuple(_DTYPE_CODES)  # activation / output dtypes the native kernels take
_REPORTED_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
# amx, bf16 activations: from this many rows the AMX GEMM outruns avx512bf16's (Emerald Rapids, SmolLM2
# shapes, one thread, against the VNNI GEMM (stop 36): 1.0x at 2 rows, 1.3x at 3, 3x at 8; against the
# vdpbf16ps one: 1.3x at 4, 7x at 32); below, avx512bf16
AMX_FROM_ROWS = 3
# amx: from this many rows dense_matmul (oneDNN's AMX GEMM) outruns it again (0.6x its time at 64 rows,
# 0.8x at 128, ~1x at 192, 1.1-1.4x at 256-512: the W4A16 kernel re-reads its activations per 16 weight rows)
AMX_DENSE_FROM_ROWS = 256
# avx512bf16, bf16 activations: from this many rows, bf16(q * scale) + oneDNN outruns the W4A16 GEMM (Zen 4,
# SmolLM2 shapes, one thread: ~1.0x at 32 rows, 1.4x at 64, 1.7x at 512); from VDPBF16PS_DENSE_FROM_ROWS
# where that GEMM is the vdpbf16ps one (`bf16_dot()` "bf16", AMD's default: stop 38 on Zen 4, with the table
# `dequantize`, 0.9-1.2x at 16 rows, 1.1-1.2x at 32 but for [576, 1536]'s 0.95x, 1.1-1.35x at 64)
DENSE_FROM_ROWS = 64
VDPBF16PS_DENSE_FROM_ROWS = 32
DENSE_CHUNK_ELEMENTS = 1 << 22  # weight elements decompressed at once (8 MiB of bf16, reused)

Call = tuple[Callable[..., object], tuple]  # a C entry and its arguments (`fn(*args)`), bound once

_ext: ModuleType | None
try:
    _ext = importlib.import_module("kvq.runtime.kernels._w4a16_cpu")
except ImportError:  # built without a C compiler
    _ext = None


_ENVIRON_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None  # CPython's bytes dict
_ENV_KEY = CPU_ISA_ENV.encode()


def cpu_isa_env() -> str | None:
    """$KVQ_CPU_ISA as set now. The C ops read it at every call (~300 a decode step), and os.environ.get
    costs ~1.5 us in Python-level encoding; on POSIX CPython this reads os.environ's own bytes dict."""
    if _ENVIRON_DATA is None:
        return os.environ.get(CPU_ISA_ENV)
    raw = _ENVIRON_DATA.get(_ENV_KEY)
    return None if raw is None else raw.decode(errors="surrogateescape")


def runnable_isas() -> tuple[str, ...]:
    """The native paths this build can run on this CPU, e.g. ('scalar', 'avx2'); () without the extension."""
    return tuple(_ext.isas()) if _ext is not None else ()


def resolve_cpu_isa(choice: str | None = None) -> str:
    """The CPU W4A16 path: `choice`, else $KVQ_CPU_ISA, else auto (amx, avx512bf16, avx512, avx2, else
    torch).

    "scalar" (the C reference) is never chosen by auto. Raises `KvqError` for an unknown choice or a path
    this CPU or build cannot run.
    """
    raw = choice if choice is not None else cpu_isa_env() or "auto"
    value = raw.strip().lower() or "auto"
    source = "cpu_isa=" if choice is not None else f"${CPU_ISA_ENV}"
    if value not in CPU_ISA_CHOICES:
        raise KvqError(f"{source} is {raw!r}; expected one of {', '.join(CPU_ISA_CHOICES)}")
    runnable = runnable_isas()
    if value == "auto":
        value = next((isa for isa in AUTO_ISAS if isa in runnable), "torch")
    elif value in NATIVE_ISAS and value not in runnable:
        if _ext is None:
            raise KvqError(
                f"{source} is {value!r} but kvq's CPU kernel (kvq.runtime.kernels._w4a16_cpu) is not built: "
                f"reinstall kvq where a C compiler is available, or set {CPU_ISA_ENV}=torch"
            )
        raise KvqError(
            f"{source} is {value!r} but this CPU cannot run it ({cpu_flags()}); "
            f"pick one of auto, {', '.join(runnable)}, torch"
        )
    if value in BF16_DOT_ISAS:
        bf16_dot()  # a bad $KVQ_CPU_DOT is said here, not at the first decode step
    return value


def bf16_dot() -> str:
    """How avx512bf16 (and amx below `AMX_FROM_ROWS` rows) multiplies bf16 activations here: "vnni" (as
    fixed point, on VNNI integer sums; Intel's default: vdpbf16ps issues once per two cycles there) or
    "bf16" (vdpbf16ps pairs; other vendors'), or what $KVQ_CPU_DOT says. Raises `KvqError` for another
    value of it."""
    assert _ext is not None, "only the native avx512bf16 and amx paths ask"
    try:
        return _ext.dot()
    except ValueError as e:
        raise KvqError(str(e)) from None


@cache
def cpu_flags() -> str:
    """The CPU's SIMD features that matter to the W4A16 paths, e.g. 'avx2 fma; no avx512f avx512bw ...'."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "CPU flags unknown"
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    have = [f for f in _REPORTED_FLAGS if f in flags]
    lacks = [f for f in _REPORTED_FLAGS if f not in flags]
    return " ".join(have or ["none of " + " ".join(_REPORTED_FLAGS)]) + (
        f"; no {' '.join(lacks)}" if have and lacks else ""
    )


def describe_cpu_path(isa: str, int4_compute: str = "w4a16") -> str:
    """One line for logs and benchmarks: the CPU's features, the W4A16 path that runs (amx: dense BF16
    Linears' decode batches too, `dense_cpu`), the W4A8 kernel with int4_compute "w4a8", and the vector
    level of the C small ops (attention, norms, rotary, store, argmax) under the same $KVQ_CPU_ISA."""
    from kvq.runtime.kernels.cpu_ops import describe_level  # imports this module: here, not at the top
    from kvq.runtime.kernels.w4a8_cpu import w4a8_path  # imports this module too

    path = "aten._weight_int4pack_mm_for_cpu" if isa == "torch" else f"kvq native {isa} kernel"
    if isa in BF16_DOT_ISAS:
        dot = "AVX-512 VNNI integer sums" if bf16_dot() == "vnni" else "vdpbf16ps"
        path += f" (bf16 activations on {dot})"
    if isa == "amx":
        path += " (dense BF16 decode batches on AMX tiles too)"
    if int4_compute == "w4a8":
        path += f"; INT4 as W4A8 (and an INT8 lm_head as W8A8) on the {w4a8_path()} kernel"
    ops = describe_level()
    return f"CPU W4A16 path: {path}, small ops: {ops} (CPU: {cpu_flags()})"


def native_scale(weight_scale: torch.Tensor) -> torch.Tensor:
    """`weight_scale` as the native kernel reads it: bf16 as stored, any other float dtype as fp32."""
    scale = weight_scale if weight_scale.dtype == torch.bfloat16 else weight_scale.float()
    return scale.contiguous()


class NativeW4A16:
    """One prepared plain (not stacked) weight's `w4a16_native` with its constant arguments bound: decode
    calls ~100 Linears per token, so the per-call Python (~1 us per line here) is worth keeping short."""

    __slots__ = (
        "weight_packed", "weight_scale", "group_size", "isa", "_isa_code", "_few_rows_code",
        "_dense_from_rows", "_ptrs", "_scale_code",
    )  # fmt: skip

    def __init__(self, weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int, isa: str):
        self.weight_packed, self.weight_scale = weight_packed, weight_scale  # keep the addresses valid
        self.group_size, self.isa, self._isa_code = group_size, isa, _ISA_CODES[isa]
        self._few_rows_code = _ISA_CODES[_few_rows_isa(isa)]
        self._dense_from_rows = dense_from_rows(isa)
        self._ptrs = (weight_packed.data_ptr(), weight_scale.data_ptr())
        self._scale_code = _DTYPE_CODES[weight_scale.dtype]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x `[M, K]` -> `[M, N]` in x.dtype."""
        if x.dtype not in _DTYPE_CODES or not x.is_contiguous():  # an error or a copy: the general path
            return w4a16_native(x, self.weight_packed, self.weight_scale, self.group_size, self.isa)
        num_rows = x.shape[0]
        if num_rows >= self._dense_from_rows and x.dtype == torch.bfloat16:
            return dense_matmul(x, self.weight_packed, self.weight_scale, self.group_size)
        code = self._isa_code if num_rows >= AMX_FROM_ROWS else self._few_rows_code
        y = torch.empty((num_rows, self.weight_packed.shape[0]), dtype=x.dtype)
        return _gemm(code, x, *self._ptrs, self._scale_code, self.group_size, y)

    def call(self, x: torch.Tensor, y: torch.Tensor) -> Call | None:
        """`self(x)`'s C call into y `[M, N]` (both contiguous, a native dtype), or None where `self(x)`
        takes torch's GEMM (`dense_matmul`)."""
        num_rows = x.shape[0]
        if num_rows >= self._dense_from_rows and x.dtype == torch.bfloat16:
            return None
        code = self._isa_code if num_rows >= AMX_FROM_ROWS else self._few_rows_code
        return _gemm_call(code, x, *self._ptrs, self._scale_code, self.group_size, y)


def _few_rows_isa(isa: str) -> str:
    """The path that runs batches of fewer than `AMX_FROM_ROWS` rows on `isa`: avx512bf16's for amx."""
    return "avx512bf16" if isa == "amx" else isa


def dense_from_rows(isa: str) -> int | float:
    """From how many bf16 rows `NativeW4A16` on `isa` runs `dense_matmul` instead (inf: never)."""
    if isa == "avx512bf16":
        return VDPBF16PS_DENSE_FROM_ROWS if bf16_dot() == "bf16" else DENSE_FROM_ROWS
    return AMX_DENSE_FROM_ROWS if isa == "amx" else float("inf")


def w4a16_native(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    group_size: int,
    isa: str,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y `[M, N]` in out_dtype (default x.dtype) = x `[M, K]` @ (q * scale)^T on path `isa` (fp32 sums;
    amx's AMX GEMM, bf16 x of at least `AMX_FROM_ROWS` rows: x @ bf16(q * scale)^T).

    `weight_packed` int32 `[N, K/8]`, `weight_scale` `[N, K/G]` from `native_scale` (both contiguous,
    checked at prepare); x fp32, bf16 or fp16 (copied if not contiguous). Threads: torch.get_num_threads().
    """
    if x.dtype not in _DTYPE_CODES:
        raise TypeError(f"the CPU W4A16 kernel takes fp32, bf16 or fp16 activations, got {x.dtype}")
    x = x.contiguous()
    y = torch.empty((x.shape[0], weight_packed.shape[0]), dtype=out_dtype or x.dtype)
    scale_code = _DTYPE_CODES[weight_scale.dtype]
    ptrs = (weight_packed.data_ptr(), weight_scale.data_ptr())
    code = _ISA_CODES[isa if x.shape[0] >= AMX_FROM_ROWS else _few_rows_isa(isa)]
    return _gemm(code, x, *ptrs, scale_code, group_size, y)


_dense_scratch: torch.Tensor | None = None


def dequantize(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int, isa: str, out: torch.Tensor
) -> None:
    """out bf16 `[N, K]` = bf16(q * scale) of the prepared weight (`native_scale`), compressed-tensors'
    decompression, bit for bit (q * scale is exact in fp32, rounded once)."""
    assert _ext is not None, "resolve_cpu_isa() picks a native path only when the extension is built"
    num_rows, in_features = out.shape
    scale_code = _DTYPE_CODES[weight_scale.dtype]
    args = (weight_packed.data_ptr(), weight_scale.data_ptr(), scale_code, num_rows, in_features, group_size)
    _ext.dequantize(_ISA_CODES[isa], torch.get_num_threads(), *args, out.data_ptr())


def dense_matmul(
    x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x bf16 `[M, K]` @ bf16(q * scale)^T through torch's BF16 GEMM, the weight decompressed in chunks of
    output rows into one reused buffer (never a whole bf16 copy of a large weight)."""
    global _dense_scratch
    (num_rows, in_features), out_features = x.shape, weight_packed.shape[0]
    rows_per_chunk = max(1, min(out_features, DENSE_CHUNK_ELEMENTS // in_features))
    need = rows_per_chunk * in_features
    if _dense_scratch is None or _dense_scratch.numel() < need:
        _dense_scratch = torch.empty(need, dtype=torch.bfloat16)
    if rows_per_chunk == out_features:
        w = _dense_scratch[:need].view(out_features, in_features)
        dequantize(weight_packed, weight_scale, group_size, "avx512bf16", w)
        return torch.nn.functional.linear(x, w)
    y = torch.empty(num_rows, out_features, dtype=x.dtype)
    for n0 in range(0, out_features, rows_per_chunk):
        n1 = min(out_features, n0 + rows_per_chunk)
        w = _dense_scratch[: (n1 - n0) * in_features].view(n1 - n0, in_features)
        dequantize(weight_packed[n0:n1], weight_scale[n0:n1], group_size, "avx512bf16", w)
        y[:, n0:n1] = torch.nn.functional.linear(x, w)
    return y


def _gemm(
    isa_code: int, x: torch.Tensor, packed: int, scale: int, scale_code: int, group_size: int, y: torch.Tensor
) -> torch.Tensor:
    """The C call on contiguous x `[M, K]` into y `[M, N]` (dtypes checked by the caller)."""
    fn, args = _gemm_call(isa_code, x, packed, scale, scale_code, group_size, y)
    fn(*args)
    return y


def _gemm_call(
    isa_code: int, x: torch.Tensor, packed: int, scale: int, scale_code: int, group_size: int, y: torch.Tensor
) -> Call:
    assert _ext is not None, "resolve_cpu_isa() picks a native path only when the extension is built"
    (num_rows, in_features), out_features = x.shape, y.shape[1]
    x_code, y_code, threads = _DTYPE_CODES[x.dtype], _DTYPE_CODES[y.dtype], torch.get_num_threads()
    args = (x.data_ptr(), x_code, num_rows, in_features, packed, scale, scale_code, out_features)
    return _ext.gemm, (isa_code, threads, *args, group_size, y.data_ptr(), y_code)


def gemm_w8(
    isa: str, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, y: torch.Tensor
) -> None:
    """The W8A16 C call (`kernels.w8a16`): contiguous x `[M, K]` into y `[M, N]` for int8 weight `[N, K]`
    and its fp32 / bf16 row scales (dtypes and shapes checked by the caller)."""
    assert _ext is not None, "resolve_cpu_isa() picks a native path only when the extension is built"
    (num_rows, in_features), out_features = x.shape, weight.shape[0]
    _ext.gemm_w8(
        _ISA_CODES[isa], torch.get_num_threads(), x.data_ptr(), _DTYPE_CODES[x.dtype], num_rows, in_features,
        weight.data_ptr(), weight_scale.data_ptr(), _DTYPE_CODES[weight_scale.dtype], out_features,
        y.data_ptr(), _DTYPE_CODES[y.dtype],
    )  # fmt: skip


def gemm_dense(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor) -> None:
    """The dense BF16 C call on AMX tiles (`_dense_cpu_amx.h`): contiguous bf16 x `[M, K]` into y `[M, N]`
    for a contiguous bf16 weight `[N, K]`, K a multiple of 32 (checked by the caller; amx runnable)."""
    fn, args = gemm_dense_call(x, weight, y)
    fn(*args)


def gemm_dense_call(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor) -> Call:
    """`gemm_dense`'s C call."""
    assert _ext is not None, "the caller checks that the amx path is runnable"
    (num_rows, in_features), out_features = x.shape, weight.shape[0]
    return _ext.gemm_dense, (
        torch.get_num_threads(), x.data_ptr(), num_rows, in_features, weight.data_ptr(), out_features,
        y.data_ptr(), _DTYPE_CODES[y.dtype],
    )  # fmt: skip
