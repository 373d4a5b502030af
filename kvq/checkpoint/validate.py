"""One validation of a checkpoint against its config.json, shared by plan, compress, check, calibrate, eval,
generate and push: a known model_type, size fields a model can have, the decoder (and MTP) layers and the
experts the config counts, and every tensor the architecture needs present with the shape the config
implies and a dtype kvq and the engines read. Headers only: no tensor data is read.

`checkpoint_mismatches` lists every `Mismatch` (what `kvq check` reports per engine); `validate_checkpoint`
raises one `KvqError` naming them. The expected tensors come from `kvq.checkpoint.specs` (the transformers
model on the meta device), built only once the layer and expert counts agree with the checkpoint, so a
hostile config cannot make it build billions of modules. Imports transformers and torch (lazily).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from kvq.checkpoint.config_sizes import Mismatch, num_experts, num_mtp_layers, size_mismatches
from kvq.checkpoint.header import TensorInfo
from kvq.checkpoint.model_config import ARCHITECTURES, WRAPPERS, TextModel, supported_model_types, text_model
from kvq.checkpoint.reader import CONFIG_NAME, Checkpoint
from kvq.checkpoint.tensor_match import tensor_mismatches
from kvq.errors import KvqError

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
_MAX_LISTED = 3


def validate_checkpoint(ckpt: Checkpoint) -> TextModel:
    """The language model of `ckpt` if its tensors are what its config.json describes; else one
    `KvqError` naming the first problems (tensor or field, expected, found) and the fix."""
    return validate_tensors(ckpt.config, ckpt.tensors, ckpt.root)


def validate_dir(path: str | Path) -> TextModel:
    """`validate_checkpoint` of the checkpoint directory `path` (opened: every header read)."""
    return validate_checkpoint(Checkpoint.open(path))


def validate_tensors(config: dict, tensors: Mapping[str, TensorInfo], root: Path) -> TextModel:
    """`validate_checkpoint` of a checkpoint already opened: its config.json and its stored tensors."""
    model, mismatches = checkpoint_mismatches(config, tensors, Path(root) / CONFIG_NAME)
    if mismatches:
        raise KvqError(describe(Path(root), mismatches))
    assert model is not None
    return model


def describe(root: Path, mismatches: list[Mismatch]) -> str:
    """One line: how many problems, the first few, and the fix of the first."""
    listed = "; ".join(f"{m.where} {m.message}" for m in mismatches[:_MAX_LISTED])
    more = f" (and {len(mismatches) - _MAX_LISTED} more)" if len(mismatches) > _MAX_LISTED else ""
    text = f"{root}: does not match its config.json ({len(mismatches)} problem(s)): {listed}{more}; "
    return " ".join((text + mismatches[0].fix).split())  # one line, whatever a message quoted


def checkpoint_mismatches(
    config: dict, tensors: Mapping[str, TensorInfo], config_path: str | Path
) -> tuple[TextModel | None, list[Mismatch]]:
    """(The language model, or None when config.json itself is refused; every mismatch found)."""
    where = str(config_path)
    if not _is_known_model_type(config):
        found = config.get("model_type")
        return None, [
            Mismatch(
                "model-type",
                "config.json model_type",
                f"is {found!r}: not an architecture kvq (or its checks) implement",
                f"use a checkpoint of a supported model_type: {supported_model_types()}",
            )
        ]
    try:
        model = text_model(config, where)
    except KvqError as e:
        return None, [Mismatch("config", "config.json", str(e).removeprefix(f"{where}: "), "fix that field")]
    mismatches = size_mismatches(model)
    if not isinstance(model.quantization_config, dict):
        mismatches.append(
            Mismatch(
                "config",
                "config.json quantization_config",
                f"is {model.quantization_config!r}, not an object",
                "restore the model's original config.json",
            )
        )
    if mismatches:
        return model, mismatches
    language = {hf: info for name, info in tensors.items() if (hf := model.hf_name(name)) is not None}
    mismatches = _layer_mismatches(model, language) + _expert_mismatches(model, language)
    if mismatches:
        return model, mismatches
    return model, tensor_mismatches(model, language, has_mtp=_has_mtp(model, language))


def _is_known_model_type(config: dict) -> bool:
    model_type = config.get("model_type")
    return isinstance(model_type, str) and (model_type in ARCHITECTURES or model_type in WRAPPERS)


def _layer_indexes(tensors: Mapping[str, TensorInfo]) -> set[int]:
    return {int(m[1]) for name in tensors if (m := _LAYER.match(name))}


def _has_mtp(model: TextModel, tensors: Mapping[str, TensorInfo]) -> bool:
    num_layers = model.fields["num_hidden_layers"]
    return any(i >= num_layers for i in _layer_indexes(tensors))


def _layer_mismatches(model: TextModel, tensors: Mapping[str, TensorInfo]) -> list[Mismatch]:
    """Decoder layers 0..N-1 all present; nothing past the MTP layers config.json declares."""
    num_layers, num_mtp = model.fields["num_hidden_layers"], num_mtp_layers(model.fields)
    found = _layer_indexes(tensors)
    path = model.field_path
    decoder = sorted(i for i in found if i < num_layers)
    if len(decoder) < num_layers:
        first_missing = next(i for i in range(len(decoder) + 1) if i not in found)
        return [
            Mismatch(
                "layers",
                f"{model.weight_prefix}model.layers.{first_missing}",
                f"is absent: config.json {path}num_hidden_layers is {num_layers}, the checkpoint holds "
                f"{len(decoder)} decoder layer(s)",
                "restore the missing shards, or set num_hidden_layers to the layers the checkpoint holds",
            )
        ]
    extra = sorted(i for i in found if i >= num_layers + num_mtp)
    if extra:
        return [
            Mismatch(
                "layers",
                f"{model.weight_prefix}model.layers.{extra[0]}",
                f"is stored, past config.json {path}num_hidden_layers {num_layers} + "
                f"num_nextn_predict_layers {num_mtp}",
                "set num_hidden_layers (or num_nextn_predict_layers) to the layers the checkpoint holds",
            )
        ]
    return []


def _expert_mismatches(model: TextModel, tensors: Mapping[str, TensorInfo]) -> list[Mismatch]:
    """As many routed experts per MoE layer as config.json says (counted before anything is built)."""
    expected = num_experts(model.fields)
    found = {int(m[1]) for name in tensors if (m := _EXPERT.search(name))}
    if found == set(range(expected)):
        return []
    stored = f"experts 0..{max(found)}" if found else "no routed experts"
    return [
        Mismatch(
            "experts",
            f"config.json {model.field_path}n_routed_experts",
            f"is {model.fields.get('n_routed_experts')!r}, the checkpoint stores {stored} "
            f"({len(found)} distinct)",
            "restore the missing expert shards, or the config.json the checkpoint was written with",
        )
    ]
