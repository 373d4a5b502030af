"""SGLang main's loading rules for compressed-tensors checkpoints, from its own code (files under
python/sglang/srt/layers/quantization/compressed_tensors/) and from SGLang PR #37207 (open), which lists
what main does not load: a mixed-precision checkpoint of INT4 experts beside FP8-block attention.
"""

from __future__ import annotations

from kvq.check.ct_layers import Matching, check_linear_layers, check_wna16_tp
from kvq.check.ct_scheme import (
    FUSED_MAPPING,
    PACK_QUANTIZED,
    first_match,
    match_fused_layer,
    scheme_map,
    shard_names,
)
from kvq.check.engine_rules import check_engine
from kvq.check.kv_scales import check_kv_scales
from kvq.check.mtp_rules import MtpLoader
from kvq.check.report import ERROR, WARNING, EngineVerdict
from kvq.check.view import FP8, INT4, MOE, CheckpointView, EngineLayer
from kvq.checkpoint.mtp_layers import sglang_nextn_name

SOURCE = "sglang compressed_tensors/compressed_tensors.py"
WNA16_SOURCE = "sglang compressed_tensors/schemes/compressed_tensors_wNa16.py"
_SHARED_EXPERT_FUSION_MODELS = ("deepseek_v3", "kimi_k2", "glm_moe_dsa")


def should_ignore_layer(name: str, ignore: list[str]) -> bool:
    """utils.py `should_ignore_layer`: entries match as `re:` regex or as case-insensitive substrings
    (`check_equal_or_regex_match`); a fused layer's parts must all be ignored or none."""
    leaf = name.rpartition(".")[2]
    if leaf in FUSED_MAPPING and name not in ignore:
        shards = [any(first_match(s, [entry], True) for entry in ignore) for s in shard_names(name)]
        if any(shards) and not all(shards):
            raise ValueError(f"Found a different quantization schemes for {FUSED_MAPPING[leaf]} in {name}")
        return all(shards)
    return any(first_match(name, [entry], True) for entry in ignore)


def find_matched_target(name: str, cls_name: str, targets: list[str]) -> str | None:
    """utils.py `find_matched_target`: the layer name, then the class name (substring), then the fused
    parts; no match raises "Unable to find matching target"."""
    found = (
        first_match(name, targets) or first_match(cls_name, targets, True) or match_fused_layer(name, targets)
    )
    if found is None:
        raise ValueError(f"Unable to find matching target for {name} in the compressed-tensors config")
    return found


# `_get_scheme_from_parts` reads `self.quant_format`, the top-level format, for every layer.
MATCHING = Matching("sglang", should_ignore_layer, find_matched_target, per_group_format=False)


def check(view: CheckpointView, tp: int) -> EngineVerdict:
    verdict = EngineVerdict("sglang", tp)
    if check_engine(view, verdict, check_layers, SGLANG_MTP):
        _check_dsa_indexer(view, verdict)
        _check_shared_expert_fusion(view, verdict)
        check_kv_scales(view, verdict, attn_name=".self_attn.attn.")
    return verdict


def check_layers(view: CheckpointView, verdict: EngineVerdict, tp: int) -> None:
    """Each of `view.layers` resolved to its scheme, its stored form and TP split checked."""
    if not view.quant.get("config_groups"):
        return
    resolved = check_linear_layers(view, verdict, MATCHING, SOURCE)
    for layer in view.layers:
        if layer.kind == MOE:
            _check_moe(view, verdict, layer)
        elif layer.name in resolved:  # SGLang runs vLLM's CompressedTensorsWNA16 for INT4 Linears
            check_wna16_tp(view, verdict, layer, resolved[layer.name], tp, WNA16_SOURCE)


# deepseek_nextn.py: the MTP decoder layer is built as `model.decoder`; the quantization config follows
# it through a mapper written for layer 61 only (`kvq.checkpoint.mtp_layers`).
SGLANG_MTP = MtpLoader(
    check_layers,
    rename=sglang_nextn_name,
    flag="--speculative-algorithm NEXTN (EAGLE)",
    source="python/sglang/srt/models/deepseek_nextn.py",
)


def _check_moe(view: CheckpointView, verdict: EngineVerdict, layer: EngineLayer) -> None:
    """schemes/compressed_tensors_wNa16_moe.py `CompressedTensorsWNA16MoE.__init__` (and the older
    compressed_tensors_moe.py `get_moe_method`): the MoE scheme is `target_scheme_map["Linear"]` whatever
    the experts' own targets; symmetric only (assert); the top-level format must be pack-quantized."""
    if should_ignore_layer(layer.name, list(view.quant.get("ignore") or [])):
        verdict.schemes[layer.name] = "UnquantizedFusedMoEMethod"
        return
    schemes = scheme_map(view.quant)
    linear = schemes.get("Linear")
    if linear is None:
        verdict.add(
            "sglang.moe-linear-target",
            ERROR,
            layer.name,
            "no config group targets `Linear`: the W4A16 MoE reads target_scheme_map['Linear'] only "
            "(KeyError)",
        )
        return
    weights = linear.weights
    if weights.get("type", "int") == "float":
        verdict.schemes[layer.name] = "CompressedTensorsW8A8Fp8MoE"
        return
    verdict.schemes[layer.name] = "CompressedTensorsWNA16MoE"
    if not weights.get("symmetric", True):
        verdict.add(
            "sglang.moe-symmetric",
            ERROR,
            layer.name,
            "Only symmetric quantization is supported for MoE (assert)",
        )
    if view.quant.get("format") != PACK_QUANTIZED or weights.get("num_bits") not in (4, 8):
        verdict.add(
            "sglang.moe-format",
            ERROR,
            layer.name,
            f"top-level format is {view.quant.get('format')!r}: For Fused MoE layers, only {PACK_QUANTIZED} "
            "is supported (4/8 bits); per-group formats are not read",
        )
    for shard in layer.shards:
        stored = view.linears[shard]
        if stored.form != INT4 or stored.group_size != linear.group_size:
            verdict.add(
                "sglang.moe-stored-form",
                ERROR,
                shard,
                f"stored as {stored.form} (group {stored.group_size}); the `Linear` scheme loads INT4 "
                f"group {linear.group_size}",
            )


def _check_dsa_indexer(view: CheckpointView, verdict: EngineVerdict) -> None:
    """PR #37207 item 4: SGLang main's DSA indexer takes only `.weight_scale_inv` as a block-FP8 scale;
    compressed-tensors stores it as `.weight_scale`."""
    for name, stored in view.linears.items():
        if ".indexer." in name and stored.form == FP8:
            verdict.add(
                "sglang.dsa-indexer-scale",
                ERROR,
                f"{name}.weight_scale",
                "the DSA indexer looks for .weight_scale_inv and finds compressed-tensors' .weight_scale: "
                "write "
                "the indexer in BF16 (kvq compress --target sglang)",
            )


def _check_shared_expert_fusion(view: CheckpointView, verdict: EngineVerdict) -> None:
    """PR #37207 item 3: for DeepSeek-V3-style models SGLang may fold the shared experts into the routed
    experts' kernel, which fails when the two are stored in different forms."""
    if view.model_type not in _SHARED_EXPERT_FUSION_MODELS:
        return
    routed = {s.form for n, s in view.linears.items() if ".mlp.experts." in n}
    shared = {s.form for n, s in view.linears.items() if ".mlp.shared_experts." in n}
    if routed and shared and routed != shared:
        verdict.add(
            "sglang.shared-expert-fusion",
            WARNING,
            "mlp.shared_experts",
            f"shared experts stored {sorted(shared)}, routed {sorted(routed)}: start SGLang with "
            "--disable-shared-experts-fusion if it folds them into one kernel",
        )
