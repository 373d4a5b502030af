"""Routed-expert tensor names: transformers' fused in-memory 3-D tensors vs the per-expert 2-D files.

transformers 5.17 holds experts as `mlp.experts.gate_up_proj` `[E, 2I, H]` (gate rows first, then up)
and `mlp.experts.down_proj` `[E, H, I]`; real GLM / DeepSeek checkpoints store
`mlp.experts.{e}.{gate,up,down}_proj.weight` `[I, H]`, `[I, H]`, `[H, I]`. Pure name/shape/tensor maps.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_FUSED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<param>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def split_expert_shapes(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """On-disk (name, shape) pairs for one in-memory tensor; identity for anything but fused experts."""
    match = _FUSED.match(name)
    if match is None:
        return [(name, shape)]
    prefix, param = match["prefix"], match["param"]
    num_experts, rows, cols = shape
    out: list[tuple[str, tuple[int, ...]]] = []
    for e in range(num_experts):
        if param == "gate_up_proj":
            out += [
                (f"{prefix}.{e}.gate_proj.weight", (rows // 2, cols)),
                (f"{prefix}.{e}.up_proj.weight", (rows // 2, cols)),
            ]
        else:
            out.append((f"{prefix}.{e}.down_proj.weight", (rows, cols)))
    return out


def fuse_experts(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert 2-D on-disk tensors -> transformers' fused `gate_up_proj` / `down_proj` (others kept)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
            continue
        experts.setdefault(match["prefix"], {}).setdefault(match["proj"], {})[int(match["e"])] = tensor
    for prefix, projs in experts.items():
        count = len(projs["down"])
        assert all(sorted(p) == list(range(count)) for p in projs.values()), f"{prefix}: experts missing"
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate"][e], projs["up"][e]], dim=0) for e in range(count)]
        )  # [E, 2I, H]
        out[f"{prefix}.down_proj"] = torch.stack([projs["down"][e] for e in range(count)])  # [E, H, I]
    return out
