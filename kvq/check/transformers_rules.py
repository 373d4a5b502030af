"""transformers' (5.17, with compressed-tensors 0.19) rules: it builds every stored Linear as an
`nn.Linear`, applies each config group to the modules its targets match, loads the stored tensors of that
group's format and decompresses them. Loading is not running: FP8 float-quantized Linears with dynamic
per-group input activations run only when in_features is a multiple of the group."""

from __future__ import annotations

import re

from kvq.check.ct_layers import Resolved, check_form
from kvq.check.ct_scheme import first_match, scheme_class, scheme_map
from kvq.check.kv_scales import check_kv_scales
from kvq.check.report import ERROR, WARNING, EngineVerdict
from kvq.check.view import CheckpointView

_ROUTER = re.compile(r"\.mlp\.gate$")


def check(view: CheckpointView, tp: int) -> EngineVerdict:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    verdict = EngineVerdict("transformers", tp)
    if view.model_type not in CONFIG_MAPPING_NAMES:
        has_code = "auto_map" in view.config
        verdict.add(
            "transformers.model-type",
            WARNING if has_code else ERROR,
            "config.json model_type",
            f"{view.model_type!r} is not a transformers architecture"
            + ("; the checkpoint ships its own code: load with trust_remote_code=True" if has_code else ""),
        )
    if view.quant.get("config_groups"):
        _check_modules(view, verdict)
    check_kv_scales(view, verdict, attn_name=".self_attn.")
    return verdict


def _resolve(view: CheckpointView, module: str) -> Resolved:
    """compressed_tensors/utils/match.py `match_named_modules`: `re:` (re.match) or an exact name, or the
    class name (`Linear` targets every nn.Linear); the ignore list the same way."""
    if any(first_match(module, [entry]) for entry in view.quant.get("ignore") or []):
        return Resolved(None, None)
    schemes = scheme_map(view.quant)
    target = first_match(module, list(schemes)) or ("Linear" if "Linear" in schemes else None)
    scheme = schemes.get(target) if target else None
    return Resolved(scheme, scheme_class(scheme, view.quant.get("format"), per_group_format=True))


def _check_modules(view: CheckpointView, verdict: EngineVerdict) -> None:
    for module, stored in view.linears.items():
        if _ROUTER.search(module):  # a TopkRouter in transformers' MoE models, not an nn.Linear
            continue
        resolved = _resolve(view, module)
        verdict.schemes[module] = resolved.cls or "unquantized"
        if resolved.cls == "":
            verdict.add(
                "transformers.no-scheme",
                ERROR,
                module,
                "its config group has no compressed-tensors compressor",
            )
            continue
        check_form(view, verdict, module, resolved, "transformers")
        inputs = resolved.scheme.input_activations if resolved.scheme else None
        if inputs and inputs.get("dynamic") and inputs.get("strategy") == "group":
            group = int(inputs.get("group_size") or 0)
            if group and stored.shape[1] % group:
                verdict.add(
                    "transformers.dynamic-group-input",
                    ERROR,
                    module,
                    f"in_features {stored.shape[1]} is not a multiple of the dynamic activation group "
                    f"{group}: it "
                    "loads, but the first forward fails (compressed_tensors/quantization/utils/helpers.py "
                    "compute_dynamic_scales_and_zp unflattens the input into groups)",
                )
