"""Dense BF16 matmul on AMX tiles for decode-sized batches: y = x @ W^T straight from a bf16 weight `[N, K]`.

kvq's AMX GEMM (`gemm_dense` in `_linear`, `_dense_amx.h`) loads its weight tiles from the weight's
own rows: no blocked copy, the weight read once per call at about the speed the core reads memory. Up to
`DENSE_AMX_MAX_ROWS` rows it outruns torch (Emerald Rapids, one thread, SmolLM2 shapes: 1.8-3.5x torch's
one-row GEMV, 1.0-1.6x oneDNN's blocked-weight GEMM at 2-32 rows); above, its strip passes re-read the
weight and oneDNN wins (~0.55x). Used where the CPU path (`--cpu-isa`) is amx. Imports torch and
kvq.runtime.kernels.cpu.linear.
"""

from __future__ import annotations

import torch

from kvq.runtime.kernels.cpu.isa import resolve_cpu_isa
from kvq.runtime.kernels.cpu.linear import gemm_dense

DENSE_AMX_MAX_ROWS = 32  # one pass of two 16-row activation tiles (amx_pairs_dense)
_AMX_K_MULTIPLE = 32  # inputs per AMX tile


def dense_amx_applies(weight: torch.Tensor, isa: str | None = None) -> bool:
    """Whether `dense_amx_matmul` can run this weight: a contiguous bf16 CPU `[N, K]` with K a multiple of
    32, where the CPU path `isa` (None: `resolve_cpu_isa()`) is amx (decided once, at load, as the W4A16
    path is)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[1] % _AMX_K_MULTIPLE == 0
        and (resolve_cpu_isa() if isa is None else isa) == "amx"
    )


def dense_amx_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """bf16 `[M, N]` = x bf16 `[M, K]` @ weight^T (`dense_amx_applies(weight)`), fp32 sums rounded once."""
    x = x.contiguous()
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)
    gemm_dense(x, weight, y)
    return y
