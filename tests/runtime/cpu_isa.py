"""The `cpu_isa` fixture (registered in tests/runtime/conftest.py): each CPU W4A16 path (KVQ_CPU_ISA) in
turn, set in the environment for the test; a path this CPU or build cannot run is skipped by its marker."""

from __future__ import annotations

import pytest

from kvq.runtime.kernels.cpu.isa import CPU_ISA_ENV, runnable_isas

CPU_ISAS = [
    *(
        pytest.param(isa, marks=pytest.mark.skipif(isa not in runnable_isas(), reason=f"no {isa} path here"))
        for isa in ("amx", "avx512bf16", "avx512", "avx2", "scalar")
    ),
    "torch",
]
# the native SIMD paths with fp32 sums of q * x, each skipped where this CPU or build cannot run it (amx's
# batches are x @ bf16(q * scale): test_w4a16_cpu_amx.py)
SIMD_ISAS = CPU_ISAS[1:4]
needs_amx = pytest.mark.skipif("amx" not in runnable_isas(), reason="no amx path here (AMX-BF16 CPU and OS)")
needs_native = pytest.mark.skipif("scalar" not in runnable_isas(), reason="kvq's CPU extension is not built")


@pytest.fixture(params=CPU_ISAS)
def cpu_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(CPU_ISA_ENV, request.param)
    return request.param
