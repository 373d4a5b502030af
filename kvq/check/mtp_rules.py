"""Whether vLLM and SGLang load a checkpoint's MTP / NextN layers to speculate, and which rule breaks it.

Both engines build the MTP layer from the checkpoint's own quantization_config (vLLM deepseek_mtp.py
`DeepSeekMultiTokenPredictorLayer`, SGLang deepseek_nextn.py `DeepseekModelNextN`): its decoder layer
resolves like a main layer, under the name the engine gives it (`kvq.checkpoint.mtp_layers`), so the
engine's own layer rules run on it; `eh_proj` is a plain `nn.Linear` (dense only). Findings go to the
verdict's MTP half, rules named `<engine>.mtp-<rule>`: an engine serves the main model without them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from kvq.check.report import ERROR, WARNING, EngineVerdict
from kvq.check.view import DENSE, CheckpointView
from kvq.checkpoint.config_sizes import num_mtp_layers
from kvq.checkpoint.header import read_header
from kvq.checkpoint.mtp_layers import MTP_OWN_MODULES, mtp_layer_indexes, sglang_renamed_entry
from kvq.errors import KvqError


@dataclass(frozen=True)
class MtpLoader:
    """How one engine loads MTP layers: its layer rules, the name it gives an MTP decoder module (None:
    the checkpoint's), the server flag that loads them and the loader file."""

    check_layers: Callable[[CheckpointView, EngineVerdict, int], None]
    rename: Callable[[str], str] | None
    flag: str
    source: str


def check_mtp(view: CheckpointView, verdict: EngineVerdict, tp: int, loader: MtpLoader) -> None:
    """The MTP verdict: every declared MTP layer indexed, its own modules dense, its decoder layer
    resolving to the form it is stored in, and its KV scales beside the main layers'."""
    verdict.num_mtp_layers = num_mtp_layers(view.config)
    if not verdict.num_mtp_layers:
        return
    missing = [i for i in mtp_layer_indexes(view.config) if _check_present(view, verdict, loader, i)]
    if missing:
        return
    for layer in view.mtp_layers:
        if layer.is_always_dense and view.linears[layer.name].form != DENSE:
            verdict.add_mtp(
                f"{verdict.engine}.mtp-dense-only",
                ERROR,
                layer.name,
                f"stored as {view.linears[layer.name].form}, but {loader.source} builds it as a plain "
                "nn.Linear that loads only a dense `.weight`: keep it unquantized (ignore it in the recipe)",
            )
    _check_decoder_layers(view, verdict, tp, loader)
    _check_kv_scales(view, verdict)


def _check_present(view: CheckpointView, verdict: EngineVerdict, loader: MtpLoader, index: int) -> bool:
    """Record an error and return True when MTP layer `index` (or one of its own modules) is not in the
    weight index: the engine then refuses to speculate or drafts from uninitialized weights."""
    prefix = f"model.layers.{index}."
    stored = {n for n in view.tensors if n.startswith(prefix)}
    absent = [f"{prefix}{m}.weight" for m in MTP_OWN_MODULES if f"{prefix}{m}.weight" not in stored]
    if not any(n.startswith(f"{prefix}self_attn.") for n in stored):
        absent.append(f"{prefix}self_attn")
    if not absent:
        return False
    unindexed = _unindexed_shards(view.root, prefix)
    where = f"; its tensors are in {', '.join(unindexed)}, which the index does not list" if unindexed else ""
    verdict.add_mtp(
        f"{verdict.engine}.mtp-missing",
        ERROR,
        prefix.rstrip(".") if len(absent) == len(MTP_OWN_MODULES) + 1 else absent[0],
        f"config.json declares num_nextn_predict_layers {verdict.num_mtp_layers}, but "
        f"{'the layer' if len(absent) > 1 else 'this tensor'} is not in the weight index{where}: "
        f"{loader.flag} fails ('MTP speculative decoding layer {index} weights missing', vLLM PR #35548) or "
        "drafts from uninitialized weights (acceptance near 0); list every MTP tensor in "
        "model.safetensors.index.json, or set num_nextn_predict_layers to 0",
    )
    return True


def _unindexed_shards(root: Path, prefix: str) -> list[str]:
    """The .safetensors files beside the index that hold tensors under `prefix` but are not indexed."""
    index = root / "model.safetensors.index.json"
    if not index.exists():
        return []
    listed = index.read_text()
    out = []
    for path in sorted(root.glob("*.safetensors")):
        if f'"{path.name}"' in listed:
            continue
        try:
            header = read_header(path)
        except KvqError:
            continue
        if any(name.startswith(prefix) for name in header.tensors):
            out.append(path.name)
    return out


def _check_decoder_layers(view: CheckpointView, verdict: EngineVerdict, tp: int, loader: MtpLoader) -> None:
    """The engine's own layer rules on the MTP decoder layers, under the names the engine gives them."""
    rename = loader.rename
    layers = [
        layer if rename is None else replace(layer, name=rename(layer.name))
        for layer in view.mtp_layers
        if not layer.is_always_dense
    ]
    quant = view.quant if rename is None else _renamed_quant(view.quant)
    scratch = EngineVerdict(verdict.engine, tp)  # the layer rules read stored forms by shard name
    loader.check_layers(replace(view, layers=layers, quant=quant), scratch, tp)
    verdict.schemes.update(scratch.schemes)
    note = "" if rename is None else f" (the MTP decoder layer as {loader.source} names it)"
    for f in scratch.findings:
        rule = f"{verdict.engine}.mtp-{f.rule.partition('.')[2]}"
        verdict.add_mtp(rule, f.severity, f.where, f"{f.message}{note}")


def _renamed_quant(quant: dict) -> dict:
    """`quant` with its ignore and target entries rewritten as SGLang main's NextN mapper does."""
    groups = {
        group: {**body, "targets": [sglang_renamed_entry(t) for t in body.get("targets") or []]}
        for group, body in (quant.get("config_groups") or {}).items()
    }
    ignore = [sglang_renamed_entry(entry) for entry in quant.get("ignore") or []]
    return {**quant, "config_groups": groups, "ignore": ignore}


def _check_kv_scales(view: CheckpointView, verdict: EngineVerdict) -> None:
    """Calibrated main layers but an uncalibrated MTP layer: its own KV cache runs at scale 1.0."""
    scales = set(view.kv_scales)
    if not any(n.endswith(".self_attn.k_scale") for n in scales):
        return
    for index in mtp_layer_indexes(view.config):
        name = f"model.layers.{index}.self_attn.k_scale"
        if name not in scales:
            verdict.add_mtp(
                f"{verdict.engine}.mtp-kv-scales-missing",
                WARNING,
                name,
                "the main layers carry calibrated k_scale but the MTP layer, which has its own KV cache, "
                "does not: with --kv-cache-dtype fp8 its cache falls back to scale 1.0 (run kvq calibrate)",
            )
