"""Which kernel backend runs a call: the Triton kernels or the torch path.

Order: an explicit `backend=` argument (the engine's `EngineConfig.kernels`, resolved once at load),
else the `KVQ_KERNELS` environment variable (auto|torch|triton), else auto = Triton for CUDA tensors when
Triton imports, torch otherwise.
Imports torch only; Triton is probed with `importlib.util.find_spec`, never imported here.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Literal

import torch

from kvq.errors import KvqError
from kvq.runtime.kernel_choices import BACKEND_CHOICES

Backend = Literal["torch", "triton"]
KVQ_KERNELS_ENV = "KVQ_KERNELS"


def is_triton_installed() -> bool:
    """True when the `triton` package can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["triton"] is None (import blocked)
        return False


def resolve_backend(device: torch.device, backend: str | None = None) -> Backend:
    """The backend for tensors on `device`: `backend`, else $KVQ_KERNELS, else auto.

    Triton on CPU tensors runs under Triton's interpreter (slow; for tests). Raises `KvqError` for an
    unknown choice or when Triton is requested but not installed.
    """
    choice = backend if backend is not None else os.environ.get(KVQ_KERNELS_ENV, "auto")
    choice = choice.strip().lower() or "auto"
    if choice not in BACKEND_CHOICES:
        source = "backend=" if backend is not None else f"${KVQ_KERNELS_ENV}"
        raise KvqError(f"{source} is {choice!r}, expected one of {', '.join(BACKEND_CHOICES)}")
    if choice == "torch":
        return "torch"
    if choice == "triton":
        if not is_triton_installed():
            raise KvqError(
                "the Triton kernel backend was requested but triton is not installed: "
                "install it with `pip install -e '.[kernels]'` or set KVQ_KERNELS=torch"
            )
        return "triton"
    return "triton" if device.type == "cuda" and is_triton_installed() else "torch"
