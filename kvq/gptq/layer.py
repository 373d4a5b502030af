"""One decoder layer through GPTQ, as llm-compressor's sequential pipeline does it.

1. Calibration pass: every sample through the layer with its original weights; hooks accumulate each
   targeted Linear's input Hessian and record the routed experts' inputs (outputs are dropped). GPTAQ
   (`fp_state`: the full-precision model's hidden states, carried beside the quantized model's) runs
   each sample through the layer twice, its full-precision states first (which move on to the next
   layer), so the Linears' sums also hold `(X_fp - X)^T X`. Routed experts stay GPTQ: the two models
   route a token to different experts, so their inputs do not pair up.
2. Every target quantized: GPTQ from its Hessian (experts one at a time, from the tokens routed to
   them; an expert with fewer than `moe_min_tokens` falls back to round-to-nearest), and its
   dequantized INT4 weight written back into the layer.
3. Propagation pass: every sample through the quantized layer; these outputs (and the K/V the
   recorder sees) are what the next layer gets.
With `true_sequential` steps 1 and 2 run per group of Linears (those fed one input tensor, in the order
the forward reaches them: llama's q/k/v, o, gate/up, down), each group's pass through the layer with
the groups before it already quantized; routed experts are recorded in the last group's pass and
quantized after it. GPTAQ's full-precision passes run the quantized groups' original weights
(`_swapped`), and only the last one moves its states on.
Returns the `weight_packed` / `weight_scale` / `weight_shape` of every GPTQ'd module, in the dtypes
round-to-nearest would write. Imports torch, transformers (through kvq.calibrate) and kvq.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from kvq.calibrate.layer_stream import StreamState, run_layer
from kvq.calibrate.memory import release_freed
from kvq.calibrate.observers import KvRecorder
from kvq.checkpoint.dense import read_dense
from kvq.checkpoint.reader import Checkpoint
from kvq.checkpoint.torch_dtypes import SAFETENSORS_DTYPES
from kvq.compress.gptq_settings import GptqSettings
from kvq.errors import KvqError
from kvq.formats.pack_quantized import dequantize_pack_quantized, pack_int4, quantize_int4_group
from kvq.gptq.algorithm import GptqResult, HessianNotPositiveDefinite, gptq_quantize
from kvq.gptq.experts import DOWN, GATE_UP, ExpertInputs, expert_hessians
from kvq.gptq.hessian import HessianSum, LinearHessians
from kvq.gptq.targets import ExpertTarget, LayerTargets, LinearTarget

CALIBRATED = ("gptq", "gptaq")  # a module's "method" in the manifest when it is not round-to-nearest


@dataclass(frozen=True)
class LayerOptions:
    group_size: int
    settings: GptqSettings
    moe_min_tokens: int
    moe_calibrate_all_experts: bool
    gptaq_alpha: float | None = None  # GPTAQ's correction scale; None: GPTQ
    true_sequential: bool = False  # each group of Linears calibrated on the quantized ones before it


@dataclass
class LayerOutcome:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # staged outputs of GPTQ'd modules
    modules: dict[str, dict] = field(default_factory=dict)  # module -> how it was quantized


def quantize_layer(
    layer: nn.Module,
    layer_idx: int,
    targets: LayerTargets,
    state: StreamState,
    inputs: dict,
    recorder: KvRecorder,
    options: LayerOptions,
    ckpt: Checkpoint,
    fp_state: StreamState | None = None,
) -> LayerOutcome:
    """GPTQ every target of the loaded `layer` (GPTAQ with `fp_state`, which this carries through the
    original layer), then carry `state` through the quantized layer."""
    experts = layer.get_submodule("mlp.experts") if targets.experts else None
    captured = ExpertInputs(experts, getattr(experts, GATE_UP).shape[0]) if experts is not None else None
    groups = [targets.linears]  # [[]] when only routed experts are targeted: one pass records them
    if options.true_sequential and targets.linears:
        groups = _sequential_groups(layer, layer_idx, state, inputs, recorder, targets)
    originals: dict[str, torch.Tensor] = {}  # GPTAQ, true-sequential: the quantized Linears' own weights
    outcome = LayerOutcome()
    for g, group in enumerate(groups):
        last = g == len(groups) - 1
        hessians = LinearHessians(layer, [t.local for t in group], asymmetric=fp_state is not None)
        group_captured = captured if last else None  # routed experts: from the last pass, once
        if fp_state is None:
            _calibrate(layer, layer_idx, state, inputs, recorder, hessians, group_captured)
        else:
            for s in range(len(state.hidden)):
                fp_one = _one_sample(fp_state, s)
                with _swapped(layer, originals), hessians.capturing():
                    run_layer(
                        layer, layer_idx, fp_one, KvRecorder(recorder.layout), inputs, keep_outputs=last
                    )
                if last:
                    fp_state.hidden[s], fp_state.topk[s] = fp_one.hidden[0], fp_one.topk[0]
                _calibrate(
                    layer, layer_idx, _one_sample(state, s), inputs, recorder, hessians, group_captured
                )
        with torch.no_grad():
            for t in group:
                live = layer.get_submodule(t.local).weight
                assert isinstance(live, torch.Tensor)
                if fp_state is not None and not last:
                    originals[t.local] = live.detach().clone()
                record = {"sequential_group": g} if options.true_sequential else None
                source = _source(ckpt, t.name, live, t)
                _gptq(outcome, t.name, live, hessians.hessian(t.local), options, source, record)
        del hessians
    with torch.no_grad():
        if captured is not None and experts is not None:
            _quantize_experts(outcome, experts, captured, targets.experts, options, ckpt)
            del captured
    run_layer(layer, layer_idx, state, recorder, inputs)
    return outcome


def _sequential_groups(
    layer: nn.Module,
    layer_idx: int,
    state: StreamState,
    inputs: dict,
    recorder: KvRecorder,
    targets: LayerTargets,
) -> list[list[LinearTarget]]:
    """The targeted Linears in the order a forward reaches them, those fed the same input tensor in one
    group (llama: q/k/v, o, gate/up, down): `LinearHessians`' shared-input leaders over one sample's
    forward (their first call sets them, in call order)."""
    by_local = {t.local: t for t in targets.linears}
    probe = LinearHessians(layer, list(by_local))
    with probe.hooked():
        run_layer(
            layer, layer_idx, _one_sample(state, 0), KvRecorder(recorder.layout), inputs, keep_outputs=False
        )
    groups: dict[str, list[LinearTarget]] = {}
    for name, leader in probe.leader.items():
        groups.setdefault(leader, []).append(by_local[name])
    return list(groups.values())


@contextmanager
def _swapped(layer: nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """The named Linears run with `weights` (their full-precision ones) inside, their own after."""
    params = {name: layer.get_submodule(name).weight for name in weights}
    own = {name: p.data for name, p in params.items()}
    for name, p in params.items():
        p.data = weights[name]
    try:
        yield
    finally:
        for name, p in params.items():
            p.data = own[name]


def _calibrate(
    layer: nn.Module,
    layer_idx: int,
    samples: StreamState,
    inputs: dict,
    recorder: KvRecorder,
    hessians: LinearHessians,
    captured: ExpertInputs | None,
) -> None:
    """The calibration pass over `samples` (hooks on, outputs dropped)."""
    with hessians.hooked(), captured.hooked() if captured is not None else nullcontext():
        run_layer(layer, layer_idx, samples, KvRecorder(recorder.layout), inputs, keep_outputs=False)


def _one_sample(state: StreamState, s: int) -> StreamState:
    return StreamState(state.hidden[s : s + 1], state.topk[s : s + 1])


def _source(
    ckpt: Checkpoint, name: str, live: torch.Tensor, target: LinearTarget | ExpertTarget
) -> torch.Tensor:
    """The weight as round-to-nearest quantizes it: the layer's own copy when its dtype is that dtype."""
    dtype = SAFETENSORS_DTYPES[target.scale_dtype]
    if live.dtype == dtype:
        return live
    prefix = f"{name}."
    view = dataclasses.replace(ckpt, tensors={n: i for n, i in ckpt.tensors.items() if n.startswith(prefix)})
    return read_dense(view, prefix, torch.float32)[f"{name}.weight"].to(dtype)


def _gptq(
    outcome: LayerOutcome,
    name: str,
    live: torch.Tensor,
    hessian: HessianSum,
    options: LayerOptions,
    weight: torch.Tensor,
    record: dict | None = None,
) -> None:
    settings = options.settings
    asymmetry = hessian.normalized_cross()
    try:
        result = gptq_quantize(
            weight,
            hessian.normalized(),
            group_size=options.group_size,
            block_size=settings.block_size,
            dampening_frac=settings.dampening_frac,
            actorder=settings.actorder is not None,
            observer=settings.observer,
            observer_kwargs=settings.search,
            asymmetry=asymmetry,
            alpha=options.gptaq_alpha or 0.0,
        )
    except HessianNotPositiveDefinite as e:
        raise KvqError(
            f"{name}: its input Hessian ({hessian.num_tokens} calibration tokens) is not positive "
            f"definite after dampening with dampening_frac {settings.dampening_frac} ({e}); raise "
            "dampening_frac in the recipe's GPTQModifier (e.g. 0.05), or give more varied calibration "
            "text (--dataset, --num-samples, --seq-len)"
        ) from e
    outcome.tensors |= _stored(name, result)
    live.copy_(dequantize_pack_quantized(outcome.tensors[f"{name}.weight_packed"], result.weight_scale))
    method = "gptq" if asymmetry is None else "gptaq"
    outcome.modules[name] = {"method": method, "loss": result.loss, "num_tokens": hessian.num_tokens}
    outcome.modules[name] |= record or {}


def _stored(name: str, result: GptqResult) -> dict[str, torch.Tensor]:
    return {
        f"{name}.weight_packed": pack_int4(result.codes),  # [out, in / 8] int32
        f"{name}.weight_scale": result.weight_scale,  # [out, in / g]
        f"{name}.weight_shape": torch.tensor(list(result.codes.shape), dtype=torch.int64),
    }


def _expert_weight(experts: nn.Module, target: ExpertTarget) -> torch.Tensor:
    """The live slice of the fused tensors holding one expert projection."""
    if target.proj == "down":
        return getattr(experts, DOWN)[target.expert]  # [H, I]
    gate_up = getattr(experts, GATE_UP)[target.expert]  # [2I, H], gate rows first
    half = gate_up.shape[0] // 2
    return gate_up[:half] if target.proj == "gate" else gate_up[half:]


def _quantize_experts(
    outcome: LayerOutcome,
    experts: nn.Module,
    captured: ExpertInputs,
    targets: list[ExpertTarget],
    options: LayerOptions,
    ckpt: Checkpoint,
) -> None:
    """Each expert: Hessians from its tokens (all of them first, from the unquantized weights), then GPTQ;
    below `moe_min_tokens` routed tokens (and not calibrating all experts), round-to-nearest with min/max
    scales whatever the observer (the bytes `kvq compress`'s RTN writes for it)."""
    by_expert: dict[int, list[ExpertTarget]] = {}
    for t in targets:
        by_expert.setdefault(t.expert, []).append(t)
    for expert, group in sorted(by_expert.items()):
        routed = captured.num_tokens(expert)
        record = {"routed_tokens": routed}
        if routed < options.moe_min_tokens and not options.moe_calibrate_all_experts:
            reason = f"{routed} routed tokens, fewer than --moe-min-tokens {options.moe_min_tokens}"
            for t in group:
                live = _expert_weight(experts, t)
                codes, scale = quantize_int4_group(_source(ckpt, t.name, live, t), options.group_size)
                live.copy_(dequantize_pack_quantized(pack_int4(codes), scale))
                outcome.modules[t.name] = {"method": "rtn", "reason": reason, **record}
            continue
        h_in, h_down = expert_hessians(
            experts, captured, expert, all_tokens=options.moe_calibrate_all_experts
        )
        for t in group:
            live = _expert_weight(experts, t)
            hessian = h_down if t.proj == "down" else h_in
            _gptq(outcome, t.name, live, hessian, options, _source(ckpt, t.name, live, t), record)
        # Each expert's temporaries are sized by its own token count, so glibc cannot reuse the last
        # expert's freed blocks for the next one: without a trim the heap grows expert after expert
        # (+0.2-0.3 GB per layer on the glm4_moe bench fixture, past the printed bound).
        del h_in, h_down
        release_freed()
