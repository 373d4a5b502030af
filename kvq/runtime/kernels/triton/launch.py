"""How kvq launches its Triton kernels: compiled for CUDA tensors, interpreted for CPU tensors.

Imported only by the `*_triton.py` kernel files (never at `import kvq.runtime.kernels`); imports Triton.
Which of the two a kernel is, Triton decides when it decorates the function: with `TRITON_INTERPRET=1` in
the environment at triton's first import, every `@triton.jit` function (kvq's and triton.language's own,
`tl.sum`, `tl.cdiv`) is an interpreted one and runs on CPU tensors; without it, kernels compile for CUDA
and cannot run on CPU tensors. kvq changes nothing of Triton's: the test suite sets `TRITON_INTERPRET=1`
(tests/conftest.py) and scripts/gpu_check.sh sets 0; per launch, the launchers only read which mode
their kernel is in (`is_interpreted`) to work around the interpreter's arithmetic (see the README).
Also the one `tl.dot` the kernels call (`dot`, with its constexprs from `dot_constexprs`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kvq.errors import KvqError

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def kernel_for(kernel: Any, device: torch.device) -> Any:
    """`kernel`, to index with the grid for tensors on `device`; `KvqError` for CPU tensors and a compiled
    kernel (Triton was imported without its interpreter)."""
    if device.type != "cuda" and not isinstance(kernel, InterpretedFunction):
        raise KvqError(
            f"the Triton kernel {kernel.__name__} got {device.type} tensors, which only Triton's "
            "interpreter runs: set TRITON_INTERPRET=1 before the process starts (it is read when triton "
            "is first imported), or use the torch kernels (KVQ_KERNELS=torch)"
        )
    return kernel


def is_interpreted(kernel: Any) -> bool:
    """True when `kernel` (as returned by `kernel_for`) runs under Triton's interpreter."""
    return isinstance(kernel, InterpretedFunction)


def dot_dtype(dtype: torch.dtype, interpreted: bool) -> torch.dtype:
    """dtype of `tl.dot` operands for activations of `dtype`.

    The interpreter's bf16 `tl.dot` returns garbage, so bf16 is upgraded to fp32 there; kernels give
    fp32 operands `input_precision="ieee"` (not tf32) so fp32 results stay fp32-exact.
    """
    if dtype not in _TL_DTYPES:
        raise TypeError(f"activations must be float16, bfloat16 or float32, got {dtype}")
    return torch.float32 if dtype == torch.bfloat16 and interpreted else dtype


def tl_dtype(dtype: torch.dtype) -> Any:
    """The `tl` dtype of a torch float dtype (for constexpr arguments)."""
    return _TL_DTYPES[dtype]


def dot_constexprs(dtype: torch.dtype, interpreted: bool) -> dict[str, Any]:
    """The constexprs `DOT_DTYPE` and `IS_FP32_DOT` of a kernel whose `dot` operands are `dot_dtype`."""
    operand_dtype = dot_dtype(dtype, interpreted)
    return {"DOT_DTYPE": tl_dtype(operand_dtype), "IS_FP32_DOT": operand_dtype == torch.float32}


@triton.jit
def dot(a, b, IS_FP32_DOT: tl.constexpr):
    """`tl.dot`, fp32-exact for fp32 operands (not tf32)."""
    if IS_FP32_DOT:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


def output_dtype(dtype: torch.dtype, interpreted: bool) -> torch.dtype:
    """dtype a kernel should write for a result wanted in `dtype`: fp32 in place of bf16 under the
    interpreter, whose fp32->bf16 cast truncates (torch then rounds to nearest even)."""
    return torch.float32 if interpreted and dtype == torch.bfloat16 else dtype


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors on a CUDA device (used to size grids)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count_for(device: torch.device) -> int:
    """SM count for CUDA tensors; a small stand-in for CPU (interpreter) launches."""
    if device.type != "cuda":
        return 4
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1)."""
    return triton.next_power_of_2(max(int(n), 1))
