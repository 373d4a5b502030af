"""Fill one transformers decoder layer with its weights from the shards, one module at a time.

The layer is materialized empty (`to_empty`), then each on-disk module (`self_attn.q_proj`, one routed
expert, ...) is read and dequantized by `read_dense` and copied in, so the transient is one module, not a
second copy of the layer. Per-expert 2-D tensors (`mlp.experts.{e}.{gate,up,down}_proj.weight`) go into
transformers' fused `gate_up_proj` `[E, 2I, H]` (gate rows first) and `down_proj` `[E, H, I]`.
Imports torch and kvq.checkpoint.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

import torch
from torch import nn

from kvq.checkpoint.dense import read_dense
from kvq.checkpoint.reader import Checkpoint
from kvq.errors import KvqError

_PER_EXPERT = re.compile(r"^mlp\.experts\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")
_EXPERT_MODULE = re.compile(r"^mlp\.experts\.\d+(?=\.)")
_KV_SCALES = (".k_scale", ".v_scale", ".q_scale", ".kv_scale")  # written by calibration, not layer weights


def load_layer_weights(layer: nn.Module, ckpt: Checkpoint, layer_idx: int, names: list[str]) -> None:
    """Materialize `layer` on CPU and copy in every weight of `model.layers.{layer_idx}.` from `ckpt`.

    `names` are that layer's stored tensor names. Raises `KvqError` if a parameter has no stored tensor,
    a stored weight has no parameter, or shapes disagree.
    """
    prefix = f"model.layers.{layer_idx}."
    layer.to_empty(device="cpu")
    targets = layer.state_dict(keep_vars=True)  # parameters and persistent buffers
    computed = sorted(set(dict(layer.named_buffers())) - set(targets))
    if computed:  # to_empty leaves buffers computed in __init__ (not stored) as garbage
        raise KvqError(
            f"{type(layer).__name__} has buffers that are computed, not stored ({computed[0]}); "
            "kvq calibrate cannot stream this architecture's layers"
        )
    filled: set[str] = set()
    for module, group in _module_groups(prefix, [n for n in names if not n.endswith(_KV_SCALES)]).items():
        view = dataclasses.replace(ckpt, tensors={n: ckpt.tensors[n] for n in group})
        for name, tensor in read_dense(
            view, f"{prefix}{module}." if module else prefix, torch.float32
        ).items():
            filled.add(_copy_into(targets, name.removeprefix(prefix), tensor, ckpt, name))
    missing = sorted(_expected_slots(targets) - filled)
    if missing:
        raise KvqError(
            f"{ckpt.root}: layer {layer_idx} stores no tensor for {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}; the checkpoint does not match its config.json"
        )


def _expected_slots(targets: dict[str, torch.Tensor]) -> set[str]:
    """Every parameter to fill; fused experts count once per expert (and per gate/up half)."""
    slots: set[str] = set()
    for name, tensor in targets.items():
        if name == "mlp.experts.gate_up_proj":
            slots |= {f"{name}[{e}].{half}" for e in range(tensor.shape[0]) for half in ("gate", "up")}
        elif name == "mlp.experts.down_proj":
            slots |= {f"{name}[{e}]" for e in range(tensor.shape[0])}
        else:
            slots.add(name)
    return slots


def _module_groups(prefix: str, names: list[str]) -> dict[str, list[str]]:
    """Names by module, relative to the layer (`self_attn.q_proj`: its weight and scales); one per expert."""
    groups: dict[str, list[str]] = defaultdict(list)
    for name in names:
        local = name.removeprefix(prefix)
        expert = _EXPERT_MODULE.match(local)
        groups[expert[0] if expert else local.rpartition(".")[0]].append(name)
    return groups


def _copy_into(
    targets: dict[str, torch.Tensor], local: str, tensor: torch.Tensor, ckpt: Checkpoint, name: str
) -> str:
    """Copy one dense tensor into its parameter (or fused-expert slice); return the slot it filled."""
    match = _PER_EXPERT.match(local)
    if match is None:
        slot, target = local, targets.get(local)
    else:
        fused = "mlp.experts.down_proj" if match["proj"] == "down" else "mlp.experts.gate_up_proj"
        slot, target = f"{fused}[{match['e']}]", targets.get(fused)
        if target is not None:
            target = target[int(match["e"])]  # [2I, H] or [H, I]
            if match["proj"] != "down":
                half = target.shape[0] // 2
                target = target[:half] if match["proj"] == "gate" else target[half:]
                slot += f".{match['proj']}"
    if target is None:
        raise KvqError(
            f"{ckpt.root}: tensor {name!r} has no place in the transformers layer; "
            "the checkpoint does not match its config.json"
        )
    if tuple(target.shape) != tuple(tensor.shape):
        raise KvqError(
            f"{ckpt.root}: tensor {name!r} has shape {tuple(tensor.shape)}, but config.json implies "
            f"{tuple(target.shape)}; the checkpoint does not match its config.json"
        )
    with torch.no_grad():
        target.copy_(tensor)
    return slot
