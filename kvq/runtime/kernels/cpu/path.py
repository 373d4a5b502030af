"""One line that says which CPU kernels run (for logs and benchmarks). Imports the CPU kernel modules."""

from __future__ import annotations

from kvq.runtime.kernels.cpu.isa import cpu_flags
from kvq.runtime.kernels.cpu.ops import CpuOps
from kvq.runtime.kernels.cpu.w4a8 import w4a8_path


def describe_cpu_path(ops: CpuOps, int4_compute: str = "w4a16") -> str:
    """One line for logs and benchmarks: the CPU's features, the W4A16 path that runs (amx: dense BF16
    Linears' decode batches too, `cpu.dense`), the W4A8 kernel with int4_compute "w4a8", and the vector
    level of the C small ops (attention, norms, rotary, store) on the same path."""
    isa = ops.isa
    path = "aten._weight_int4pack_mm_for_cpu" if isa == "torch" else f"kvq native {isa} kernel"
    if ops.dot is not None:
        dot = "AVX-512 VNNI integer sums" if ops.dot == "vnni" else "vdpbf16ps"
        path += f" (bf16 activations on {dot})"
    if isa == "amx":
        path += " (dense BF16 decode batches on AMX tiles too)"
    if int4_compute == "w4a8":
        path += f"; INT4 as W4A8 (and an INT8 lm_head as W8A8) on the {w4a8_path(isa)} kernel"
    return f"CPU W4A16 path: {path}, small ops: {ops.describe_level()} (CPU: {cpu_flags()})"
