"""Summarize a checkpoint from headers alone: format, and per module kind tensors, parameters, dtypes, bytes.

Parameters count logical weight elements: a `weight_packed` int32 word holds 8 int4 values; quantization
metadata (`weight_scale`, `weight_scale_inv`, `weight_shape`, `k_scale`/`v_scale`) adds bytes, not parameters.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from kvq.checkpoint.header import TensorInfo
from kvq.checkpoint.model_config import quantization_config_of, text_model
from kvq.checkpoint.module_kind import MODULE_KINDS, module_kind
from kvq.checkpoint.reader import Checkpoint, detect_format
from kvq.errors import KvqError

METADATA_SUFFIXES = (
    "weight_scale",
    "weight_scale_inv",
    "weight_shape",
    "weight_zero_point",
    "weight_global_scale",
    "input_scale",
    "k_scale",
    "v_scale",
    "q_scale",
)


@dataclass
class KindSummary:
    tensors: int = 0
    parameters: int = 0
    bytes: int = 0
    dtypes: list[str] = field(default_factory=list)


@dataclass
class InspectReport:
    path: str
    format: str
    num_shards: int
    kinds: dict[str, KindSummary]
    total: KindSummary
    quant_method: str | None
    model: str  # the language model config.json describes, e.g. "kimi_k25: text_config kimi_k2 (deepseek_v3)"

    def to_json(self) -> dict:
        return asdict(self)


def logical_parameters(info: TensorInfo) -> int:
    """Logical weight elements stored by a tensor (0 for quantization metadata)."""
    suffix = info.name.rsplit(".", 1)[-1]
    if suffix in METADATA_SUFFIXES:
        return 0
    if suffix == "weight_packed":
        return info.numel * 8
    return info.numel


def summarize(ckpt: Checkpoint) -> InspectReport:
    """Group every stored tensor by module kind and total it; reads no tensor data."""
    report = summarize_tensors(str(ckpt.root), ckpt.tensors.values(), len(ckpt.shards), ckpt.config)
    report.format = ckpt.format
    return report


def summarize_tensors(
    path: str, tensors: Iterable[TensorInfo], num_shards: int, config: dict
) -> InspectReport:
    """`summarize` of tensors that may exist only on paper (a bare config.json)."""
    infos = list(tensors)
    kinds: dict[str, KindSummary] = defaultdict(KindSummary)
    dtypes: dict[str, set[str]] = defaultdict(set)
    for info in infos:
        kind = module_kind(info.name)
        row = kinds[kind]
        row.tensors += 1
        row.parameters += logical_parameters(info)
        row.bytes += info.nbytes
        dtypes[kind].add(info.dtype)
    ordered = {k: kinds[k] for k in MODULE_KINDS if k in kinds}
    for kind, row in ordered.items():
        row.dtypes = sorted(dtypes[kind])
    total = KindSummary(
        tensors=sum(r.tensors for r in ordered.values()),
        parameters=sum(r.parameters for r in ordered.values()),
        bytes=sum(r.bytes for r in ordered.values()),
        dtypes=sorted(set().union(*dtypes.values())) if dtypes else [],
    )
    quant = quantization_config_of(config)
    return InspectReport(
        path,
        detect_format(infos),
        num_shards,
        ordered,
        total,
        quant.get("quant_method"),
        describe_model(config),
    )


def describe_model(config: dict) -> str:
    """What config.json says the model is, for humans; never raises (inspect reads any checkpoint)."""
    try:
        model = text_model(config, "config.json")
    except KvqError as e:
        return f"{config.get('model_type')!r} (kvq does not run it: {str(e).removeprefix('config.json: ')})"
    if model.wrapper is None:
        return (
            model.model_type
            if model.architecture == model.model_type
            else f"{model.model_type} ({model.architecture})"
        )
    return (
        f"{model.wrapper}: {model.field_path}model_type {model.model_type} ({model.architecture}), "
        f"tensors under {model.weight_prefix!r}"
    )
