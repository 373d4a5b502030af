"""The dtype of GPTQ's calibration forward, decided once per run from what this CPU computes fast.

bfloat16 is llm-compressor's (its `weight_packed` bytes, bit for bit); float32 is what a CPU without
native bf16 arithmetic (AVX2 only: no avx512_bf16 or AMX) multiplies fast, where torch emulates bf16
matmuls many times slower. `auto` picks bfloat16 only where both the CPU and torch's kernels (as
$ATEN_CPU_CAPABILITY and $ONEDNN_MAX_CPU_ISA leave them) compute bf16 natively. Imports the standard
library and kvq.errors; torch only inside `detect_cpu_bf16`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvq.errors import KvqError

FORWARD_DTYPES = ("auto", "bfloat16", "float32")
DEFAULT_FORWARD_DTYPE = "auto"
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 dot products on x86
ONEDNN_ISA_ENV = "ONEDNN_MAX_CPU_ISA"
# oneDNN ISA caps that still include native bf16 (unset or ALL: no cap)
_ONEDNN_BF16_CAPS = (
    "ALL",
    "DEFAULT",
    "AVX512_CORE_BF16",
    "AVX512_CORE_FP16",
    "AVX512_CORE_AMX",
    "AVX10_1_512",
)


@dataclass(frozen=True)
class CpuBf16:
    """Whether torch multiplies bf16 natively here, and the facts that decided it (for the log line)."""

    is_native: bool
    facts: str  # e.g. "avx512_bf16; torch AVX2; ONEDNN_MAX_CPU_ISA=AVX2"


@dataclass(frozen=True)
class ForwardDtype:
    """The dtype the calibration forward runs in (a `CalibrationConfig.dtype`) and why, in one phrase."""

    dtype: str
    reason: str


def detect_cpu_bf16() -> CpuBf16:
    """The CPU's bf16 flags, torch's vector capability and the oneDNN cap, read once."""
    import torch

    flags = [f for f in BF16_FLAGS if f in _cpu_flags()]
    capability = torch.backends.cpu.get_cpu_capability()  # honours $ATEN_CPU_CAPABILITY
    onednn = os.environ.get(ONEDNN_ISA_ENV, "").strip().upper()
    is_onednn_bf16 = not onednn or onednn.startswith(_ONEDNN_BF16_CAPS)
    facts = " ".join(flags) if flags else f"no {' or '.join(BF16_FLAGS)}"
    facts += f"; torch {capability}" + (f"; {ONEDNN_ISA_ENV}={onednn}" if onednn else "")
    return CpuBf16(bool(flags) and capability.startswith("AVX512") and is_onednn_bf16, facts)


def resolve_forward_dtype(choice: str, cpu: CpuBf16 | None = None) -> ForwardDtype:
    """`choice` (one of FORWARD_DTYPES) as a concrete dtype; auto asks `cpu` (detected when None)."""
    check_forward_dtype(choice)
    if choice != "auto":
        return ForwardDtype(choice, f"--gptq-forward-dtype {choice}")
    cpu = cpu if cpu is not None else detect_cpu_bf16()
    if cpu.is_native:
        return ForwardDtype("bfloat16", f"auto: native bf16 ({cpu.facts}); llm-compressor's bytes")
    return ForwardDtype(
        "float32",
        f"auto: no native bf16 arithmetic ({cpu.facts}); --gptq-forward-dtype bfloat16 for "
        "llm-compressor's exact bytes",
    )


def check_forward_dtype(choice: str) -> None:
    if choice not in FORWARD_DTYPES:
        raise KvqError(f"--gptq-forward-dtype {choice!r} is unknown; use one of {', '.join(FORWARD_DTYPES)}")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())
