"""Which CPU path runs: the ISA choice (`resolve_cpu_isa`: the `cpu_isa` setting, else $KVQ_CPU_ISA, else
the best this CPU and build run; an engine resolves it once, `CpuOps.choose`), the C extension `_linear` as
loaded, and the CPU's flags for messages. Imports torch, kvq.errors and kvq.runtime.kernel_choices.
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
from kvq.runtime.kernel_choices import CPU_ISA_CHOICES

CPU_ISA_ENV = "KVQ_CPU_ISA"
CPU_DOT_ENV = "KVQ_CPU_DOT"  # how avx512bf16 multiplies bf16 activations: vnni or bf16 (unset: by CPU vendor)
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
    _ext = importlib.import_module("kvq.runtime.kernels.cpu._linear")
except ImportError:  # built without a C compiler
    _ext = None


def runnable_isas() -> tuple[str, ...]:
    """The native paths this build can run on this CPU, e.g. ('scalar', 'avx2'); () without the extension."""
    return tuple(_ext.isas()) if _ext is not None else ()


def resolve_cpu_isa(choice: str | None = None) -> str:
    """The CPU W4A16 path: `choice`, else $KVQ_CPU_ISA, else auto (amx, avx512bf16, avx512, avx2, else
    torch).

    "scalar" (the C reference) is never chosen by auto. Raises `KvqError` for an unknown choice or a path
    this CPU or build cannot run.
    """
    raw = choice if choice is not None else os.environ.get(CPU_ISA_ENV) or "auto"
    value = raw.strip().lower() or "auto"
    source = "--cpu-isa" if choice is not None else f"${CPU_ISA_ENV}"
    if value not in CPU_ISA_CHOICES:
        raise KvqError(f"{source} is {raw!r}; expected one of {', '.join(CPU_ISA_CHOICES)}")
    runnable = runnable_isas()
    if value == "auto":
        value = next((isa for isa in AUTO_ISAS if isa in runnable), "torch")
    elif value in NATIVE_ISAS and value not in runnable:
        if _ext is None:
            raise KvqError(
                f"{source} is {value!r} but kvq's CPU kernel (kvq.runtime.kernels.cpu._linear) is not built: "
                f"reinstall kvq where a C compiler is available, or pass --cpu-isa torch"
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
