"""The per-layer part both vLLM and SGLang share: resolve each Linear layer's scheme (ignore list, then
target matching) the way the engine does, and check that every stored tensor has the form that scheme
loads. Each engine passes its own `Matching` (their ignore and target rules differ in small ways).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvq.check.ct_scheme import WNA16, Scheme, scheme_class, scheme_map, shard_names
from kvq.check.report import ERROR, WARNING, EngineVerdict
from kvq.check.view import DENSE, FP8, INT4, LINEAR, CheckpointView, EngineLayer

_ROW_PARALLEL = ("o_proj", "down_proj")
_REPLICATED = ("q_a_proj", "kv_a_proj_with_mqa", "fused_qkv_a_proj", "wq_b", "wk", "weights_proj", "gate")


@dataclass(frozen=True)
class Matching:
    """How one engine resolves a layer: `should_ignore(name, ignore)` (raises `ValueError` like the
    engine), `find_target(name, class_name, targets)`, and whether groups' own `format` counts."""

    engine: str
    should_ignore: Callable[[str, list[str]], bool]
    find_target: Callable[[str, str, list[str]], str | None]
    per_group_format: bool


@dataclass(frozen=True)
class Resolved:
    scheme: Scheme | None
    cls: str | None  # scheme class; None = unquantized; "" = no scheme (the engine raises)


def is_checked_format(view: CheckpointView, verdict: EngineVerdict) -> bool:
    """compressed-tensors (or unquantized / FP8-source) checkpoints are checked; others get a warning."""
    if view.quant.get("quant_method") in (None, "compressed-tensors", "fp8"):
        return True
    verdict.add(
        f"{verdict.engine}.quant-method",
        WARNING,
        "quantization_config",
        f"quant_method {view.quant.get('quant_method')!r} is not compressed-tensors: not checked",
    )
    return False


def class_name(layer: EngineLayer) -> str:
    """The vLLM/SGLang layer class: every Linear class name contains `Linear` (class-name targets)."""
    if layer.leaf == "qkv_proj":
        return "QKVParallelLinear"
    if layer.leaf in ("gate_up_proj", "fused_qkv_a_proj"):
        return "MergedColumnParallelLinear"
    return "RowParallelLinear" if layer.leaf in _ROW_PARALLEL else "ColumnParallelLinear"


def parallel_style(layer: EngineLayer) -> str:
    """row (input split over TP ranks), column (output split) or replicated."""
    if layer.leaf in _REPLICATED:
        return "replicated"
    return "row" if layer.leaf in _ROW_PARALLEL else "column"


def resolve(view: CheckpointView, name: str, cls_name: str, matching: Matching) -> Resolved:
    """`get_scheme_dict` then `_get_scheme_from_parts` for one layer name (ValueError propagates)."""
    ignore = list(view.quant.get("ignore") or [])
    if matching.should_ignore(name, ignore):
        return Resolved(None, None)
    schemes = scheme_map(view.quant)
    target = matching.find_target(name, cls_name, list(schemes))
    scheme = schemes[target] if target is not None else None
    return Resolved(
        scheme, scheme_class(scheme, view.quant.get("format"), per_group_format=matching.per_group_format)
    )


def check_linear_layers(
    view: CheckpointView, verdict: EngineVerdict, matching: Matching, source: str
) -> dict:
    """Resolve every Linear layer; record errors for ignore/target conflicts, no scheme, and stored forms
    that differ from what the scheme loads. Returns layer name -> `Resolved`."""
    out: dict[str, Resolved] = {}
    rule = matching.engine
    for layer in (lay for lay in view.layers if lay.kind == LINEAR):
        if layer.is_always_dense:
            _check_always_dense(view, verdict, layer, rule)
            continue
        try:
            resolved = resolve(view, layer.name, class_name(layer), matching)
        except ValueError as e:
            verdict.add(f"{rule}.scheme-lookup", ERROR, layer.name, f"{e} ({source} get_scheme_dict)")
            continue
        out[layer.name] = resolved
        verdict.schemes[layer.name] = resolved.cls or "unquantized"
        if resolved.cls == "":
            verdict.add(
                f"{rule}.no-scheme",
                ERROR,
                layer.name,
                f"group {resolved.scheme.group if resolved.scheme else '?'} with format "
                f"{resolved.scheme.format if resolved.scheme else None!r} (top level "
                f"{view.quant.get('format')!r}) gives no compressed-tensors scheme: "
                "NotImplementedError at load "
                f"({source} _get_scheme_from_parts)",
            )
            continue
        _check_shards(view, verdict, layer, resolved, matching, source)
    return out


def _check_always_dense(view: CheckpointView, verdict: EngineVerdict, layer: EngineLayer, rule: str) -> None:
    stored = view.linears[layer.name]
    verdict.schemes[layer.name] = "unquantized"
    if stored.form != DENSE:
        verdict.add(
            f"{rule}.dense-only",
            ERROR,
            layer.name,
            f"stored as {stored.form}, but the engine builds this layer with quant_config=None and loads "
            "only a dense `.weight`: keep it unquantized (ignore it in the recipe)",
        )


def _check_shards(
    view: CheckpointView,
    verdict: EngineVerdict,
    layer: EngineLayer,
    resolved: Resolved,
    matching: Matching,
    source: str,
) -> None:
    rule = matching.engine
    if len(layer.shards) > 1:  # the engine resolves the fused layer once; each part must agree
        for shard, shard_name in zip(layer.shards, shard_names(layer.name), strict=True):
            own = resolve(view, shard_name, "Linear", matching)
            if (own.scheme and own.scheme.group, own.cls) != (
                resolved.scheme and resolved.scheme.group,
                resolved.cls,
            ):
                verdict.add(
                    f"{rule}.fused-scheme-equal",
                    ERROR,
                    shard,
                    f"resolves to {own.cls or 'unquantized'} but its fused layer {layer.leaf} to "
                    f"{resolved.cls or 'unquantized'}: fused parts must share one scheme ({source} "
                    "find_matched_target / _match_fused_layer)",
                )
    for shard in layer.shards:
        check_form(view, verdict, shard, resolved, rule)


def check_form(
    view: CheckpointView, verdict: EngineVerdict, shard: str, resolved: Resolved, rule: str
) -> None:
    stored = view.linears[shard]
    expected = {WNA16: INT4, None: DENSE}.get(resolved.cls, FP8)
    if stored.form != expected:
        verdict.add(
            f"{rule}.stored-form",
            ERROR,
            shard,
            f"stored as {stored.form} but the engine resolves it to {resolved.cls or 'unquantized'}, which "
            f"loads {expected} tensors: the tensors and the quantization_config disagree",
        )
        return
    scheme = resolved.scheme
    if expected == INT4 and scheme is not None and stored.group_size != scheme.group_size:
        is_channel = scheme.group_size == -1 and stored.group_size == stored.shape[1]
        if not is_channel:
            verdict.add(
                f"{rule}.group-size",
                ERROR,
                shard,
                f"weight_scale implies group size {stored.group_size}, the scheme says {scheme.group_size}",
            )
    if expected == INT4 and scheme is not None:
        is_symmetric = scheme.weights.get("symmetric", True)
        if stored.has_zero_point == is_symmetric:
            verdict.add(
                f"{rule}.zero-point",
                ERROR,
                shard,
                f"weight_zero_point {'present' if stored.has_zero_point else 'missing'} but the scheme is "
                f"{'symmetric' if is_symmetric else 'asymmetric'}",
            )


def check_wna16_tp(
    view: CheckpointView, verdict: EngineVerdict, layer: EngineLayer, resolved: Resolved, tp: int, source: str
) -> None:
    """A row-parallel INT4 layer splits its input over the TP ranks: each rank's part must be whole groups
    (`CompressedTensorsWNA16.create_weights`: verify_group_size_divides_partition)."""
    if resolved.cls != WNA16 or resolved.scheme is None or parallel_style(layer) != "row":
        return
    in_features = view.linears[layer.shards[0]].shape[1]
    group = resolved.scheme.group_size
    group = in_features if group == -1 else group
    if in_features % tp or (in_features // tp) % group:
        verdict.add(
            f"{verdict.engine}.wna16-tp-group",
            ERROR,
            layer.name,
            f"input per TP rank {in_features}/{tp} is not a multiple of group size {group} ({source} "
            "create_weights: verify_group_size_divides_partition)",
        )
