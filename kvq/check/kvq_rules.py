"""The kvq runtime's loading rules, read from the runtime itself (its model registry, the loader's
quantization methods, the W4A16 kernel's group sizes and, at `--tp N`, the splits its tensor-parallel
loader makes: `kvq.check.tp_rules`), so they change with it. Imports torch."""

from __future__ import annotations

from kvq.check.kv_scales import check_kv_scales
from kvq.check.report import ERROR, EngineVerdict
from kvq.check.tp_rules import check_kvq_tp
from kvq.check.view import INT4, CheckpointView


def check(view: CheckpointView, tp: int) -> EngineVerdict:
    from kvq.checkpoint.model_config import ARCHITECTURES
    from kvq.formats.shapes import GROUP_SIZES
    from kvq.runtime.loader import SUPPORTED_QUANT_METHODS
    from kvq.runtime.models.registry import MODELS

    verdict = EngineVerdict("kvq", tp)
    architecture = ARCHITECTURES.get(view.model_type, view.model_type)  # kimi_k2 runs as deepseek_v3
    if architecture not in MODELS:
        verdict.add(
            "kvq.model-type",
            ERROR,
            "config.json model_type",
            f"{view.model_type!r} is not a kvq runtime model (kvq/runtime/models/registry.py: "
            f"{', '.join(sorted(MODELS))}, kimi_k2)",
        )
    else:
        check_kvq_tp(view, verdict, tp)
    if view.quant.get("quant_method") not in SUPPORTED_QUANT_METHODS:
        verdict.add(
            "kvq.quant-method",
            ERROR,
            "quantization_config.quant_method",
            f"{view.quant.get('quant_method')!r} is not loaded by kvq/runtime/loader.py",
        )
    for module, stored in view.linears.items():
        verdict.schemes[module] = stored.form
        if stored.form != INT4:
            continue
        if stored.group_size not in GROUP_SIZES:
            verdict.add(
                "kvq.group-size",
                ERROR,
                f"{module}.weight_scale",
                f"group size {stored.group_size}; the W4A16 kernel runs {GROUP_SIZES}",
            )
        if stored.has_zero_point:
            verdict.add(
                "kvq.zero-point",
                ERROR,
                f"{module}.weight_zero_point",
                "asymmetric INT4: the loader takes symmetric weights only",
            )
    check_kv_scales(view, verdict, attn_name=".self_attn.")
    return verdict
