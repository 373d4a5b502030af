"""How kvq launches its Triton kernels: compiled for CUDA tensors, interpreted for CPU tensors.

Imported only by the `*_triton.py` kernel files (never at `import kvq.runtime.kernels`); imports Triton.
Triton picks the interpreter when a function is decorated (TRITON_INTERPRET=1 at import), but triton is
often imported early by others (compressed_tensors, transformers): for CPU tensors `kernel_for` then
runs the kernel's Python source under the interpreter itself, making nested `@triton.jit` calls
(tl.sum, tl.cdiv, our helpers) interpreted for the duration of the launch.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction, _patch_lang
from triton.runtime.jit import JITFunction

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@functools.cache
def _interpreted(fn: Callable) -> InterpretedFunction:
    return InterpretedFunction(fn)


def _call_interpreted(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
    """A nested @triton.jit call inside an interpreted launch: run its source under the interpreter and
    undo its patches of triton.language afterwards (InterpretedFunction.__call__ leaves tl.core patched,
    which breaks later compiles in the same process)."""
    scope = _patch_lang(self.fn)
    try:
        return _interpreted(self.fn).rewrite()(*args, **kwargs)
    finally:
        scope.restore()


@contextlib.contextmanager
def _jit_calls_interpreted() -> Iterator[None]:
    """While active, a call to a compiled-mode @triton.jit function runs it under the interpreter."""
    original = JITFunction.__call__
    JITFunction.__call__ = _call_interpreted  # type: ignore[method-assign]
    try:
        yield
    finally:
        JITFunction.__call__ = original  # type: ignore[method-assign]


class InterpretedLaunch:
    """`launch[grid](*args)` of a kernel under the interpreter, whatever mode triton was imported in."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel if isinstance(kernel, InterpretedFunction) else _interpreted(kernel.fn)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            if isinstance(tl.sum, InterpretedFunction):  # TRITON_INTERPRET=1 was set before triton loaded
                self.kernel[grid](*args, **kwargs)
                return
            with _jit_calls_interpreted():
                self.kernel[grid](*args, **kwargs)

        return launch


def kernel_for(kernel: Any, device: torch.device) -> Any:
    """What to index with the grid for tensors on `device`: the compiled kernel on CUDA, else interpreted."""
    if device.type == "cuda" and not isinstance(kernel, InterpretedFunction):
        return kernel
    return InterpretedLaunch(kernel)


def is_interpreted(kernel: Any) -> bool:
    """True when `kernel` (as returned by `kernel_for`) runs under Triton's interpreter."""
    return isinstance(kernel, InterpretedLaunch)


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
