"""Which weights of each decoder layer GPTQ quantizes, located in transformers' layer and checked up front.

The INT4 modules of a `kvq compress` plan, by layer: plain `nn.Linear`s (`self_attn.q_proj`, a shared
expert, a dense MLP, ...) and slices of the fused routed experts (`mlp.experts.{e}.{gate,up,down}_proj`
-> `gate_up_proj[e]` rows `[:I]` / `[I:]`, `down_proj[e]`). Every target is checked against the model
built on the meta device (a module of that name and shape must exist) before any work starts. INT4
modules outside the layers the forward runs (MTP layers) are quantized round-to-nearest, deliberately
(docs/mtp.md): GPTQ's streamed forward does not run the MTP layer.
Imports torch and kvq (compress plan, errors).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from kvq.compress.tensor_plan import INT4, CompressPlan, TensorTask
from kvq.errors import KvqError
from kvq.gptq.experts import DOWN, GATE_UP

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj$")
NOT_REACHED = "MTP layer: round-to-nearest by design, GPTQ's forward does not run it (docs/mtp.md)"


@dataclass(frozen=True)
class LinearTarget:
    name: str  # checkpoint module name, e.g. model.layers.3.self_attn.q_proj
    local: str  # its name inside the decoder layer
    scale_dtype: str  # safetensors code of its weight_scale (the dtype it is quantized in)


@dataclass(frozen=True)
class ExpertTarget:
    name: str
    expert: int
    proj: str  # gate | up | down
    scale_dtype: str


@dataclass
class LayerTargets:
    linears: list[LinearTarget] = field(default_factory=list)
    experts: list[ExpertTarget] = field(default_factory=list)


def find_targets(
    plan: CompressPlan, layers: nn.ModuleList, root: str, prefix: str = ""
) -> tuple[list[LayerTargets], list[str]]:
    """Per decoder layer its GPTQ targets, and the INT4 modules no forward reaches (kept RTN). `prefix`:
    what the checkpoint's names put before transformers' (`language_model.` in a multimodal one)."""
    targets = [LayerTargets() for _ in layers]
    unreached: list[str] = []
    for task in plan.tasks:
        if task.action != INT4:
            continue
        match = _LAYER.match(task.module.removeprefix(prefix)) if task.module.startswith(prefix) else None
        if match is None or int(match[1]) >= len(layers):
            unreached.append(task.module)
            continue
        layer, local = layers[int(match[1])], match[2]
        expert = _EXPERT.match(local)
        if expert is None:
            _check_linear(layer, local, task, root)
            targets[int(match[1])].linears.append(LinearTarget(task.module, local, task.outputs[1].dtype))
        else:
            _check_expert(layer, int(expert[1]), expert[2], task, root)
            targets[int(match[1])].experts.append(
                ExpertTarget(task.module, int(expert[1]), expert[2], task.outputs[1].dtype)
            )
    return targets, sorted(unreached)


def int4_shapes(plan: CompressPlan) -> dict[str, tuple[int, ...]]:
    """`[out, in]` of every module quantized to INT4 (its weight's task; a biased Linear also has a
    task for its bias under the same module)."""
    return {task.module: task.source.shape for task in plan.tasks if task.action == INT4}


def dense_in_features(targets: list[LayerTargets], plan: CompressPlan) -> dict[str, int]:
    """`in_features` of every non-expert target (these see every calibration token)."""
    shapes = int4_shapes(plan)
    return {t.name: shapes[t.name][1] for layer in targets for t in layer.linears}


def _mismatch(task: TensorTask, root: str, found: str) -> KvqError:
    return KvqError(
        f"{task.source.file}: tensor {task.source.name!r} {list(task.source.shape)} has no matching "
        f"module in transformers' {root} model ({found}); GPTQ runs transformers' own layers, so the "
        "checkpoint must match its config.json"
    )


def _check_linear(layer: nn.Module, local: str, task: TensorTask, root: str) -> None:
    try:
        module = layer.get_submodule(local)
    except AttributeError:
        raise _mismatch(task, root, f"no submodule {local!r}") from None
    if not isinstance(module, nn.Linear):
        raise _mismatch(task, root, f"{local!r} is a {type(module).__name__}, not a Linear")
    if tuple(module.weight.shape) != tuple(task.source.shape):
        raise _mismatch(task, root, f"{local!r} has weight shape {list(module.weight.shape)}")


def _check_expert(layer: nn.Module, expert: int, proj: str, task: TensorTask, root: str) -> None:
    try:
        experts = layer.get_submodule("mlp.experts")
    except AttributeError:
        raise _mismatch(task, root, "no fused mlp.experts module") from None
    gate_up, down = getattr(experts, GATE_UP, None), getattr(experts, DOWN, None)
    if gate_up is None or down is None or gate_up.ndim != 3 or down.ndim != 3:
        raise _mismatch(task, root, f"mlp.experts is a {type(experts).__name__} without 3-D gate_up/down")
    num_experts, two_i, hidden = gate_up.shape
    want = (hidden, two_i // 2) if proj == "down" else (two_i // 2, hidden)
    if expert >= num_experts or tuple(down.shape) != (num_experts, hidden, two_i // 2):
        raise _mismatch(task, root, f"{num_experts} experts of gate_up_proj {list(gate_up.shape)}")
    if tuple(task.source.shape) != want:
        raise _mismatch(task, root, f"expert {proj}_proj weights are {list(want)}")
