"""The input check the integrity kernels' launchers share (`step_check`, `stamp_check`): named tensors'
shapes, integer dtypes and one device, each error naming the tensor. Imports torch only.
"""

from __future__ import annotations

import torch


def check_tensors(
    tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], integer: tuple[str, ...] = ()
) -> None:
    """Each tensor named in `shapes` has that shape; those named in `integer` have an integer dtype and
    all others int64; all share a device. ValueError (shape, device) or TypeError (dtype) otherwise."""
    for name, shape in shapes.items():
        found = tuple(tensors[name].shape)
        if found != shape:
            raise ValueError(f"{name} has shape {found}, expected {shape}")
    wrong = [
        f"{name} {t.dtype}"
        for name, t in tensors.items()
        if (
            (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
            if name in integer
            else t.dtype != torch.int64
        )
    ]
    if wrong:
        int64 = [name for name in tensors if name not in integer]
        rule = f"{', '.join(int64)} must be int64" + (f" and {', '.join(integer)} integer" if integer else "")
        raise TypeError(f"{rule}; got {', '.join(wrong)}")
    if len({t.device for t in tensors.values()}) != 1:
        raise ValueError(f"{', '.join(tensors)} must share a device")
