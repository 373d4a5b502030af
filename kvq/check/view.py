"""One parsed view of a checkpoint for `kvq check`: its config, every Linear's stored form, and the layers an
engine builds from them (fused q/k/v, gate/up, q_a/kv_a; one MoE layer per `mlp.experts`). Headers only.

Any checkpoint is read, not only kvq's: compressed-tensors `pack-quantized` (`weight_packed`), `float-
quantized` FP8 (`weight` + `weight_scale`), FP8-block sources (`weight_scale_inv`) and plain BF16. A
Kimi K2.5/K2.6 config nests the language model under `text_config`; its fields are read from there.
Imports no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kvq.checkpoint.dtypes import FP8_CODES
from kvq.checkpoint.fused_layers import fused_layer
from kvq.checkpoint.header import TensorInfo
from kvq.checkpoint.reader import Checkpoint
from kvq.compress.tensor_plan import is_linear_weight

INT4, FP8, FP8_SCALE_INV, DENSE = "int4", "fp8", "fp8_scale_inv", "dense"  # stored forms of a Linear
LINEAR, MOE = "linear", "moe"
_EXPERT = re.compile(r"^(?P<layer>.*\.mlp\.experts)\.\d+\.(gate|up|down)_proj$")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Built by vLLM and SGLang without a quant_config whatever the checkpoint says (glm4_moe / deepseek_v2
# `self.gate = ReplicatedLinear(..., quant_config=None)`, the DSA indexer's `weights_proj`, the MTP
# layer's `eh_proj` = `nn.Linear` in deepseek_mtp.py / deepseek_nextn.py), so they must be stored dense.
_ALWAYS_DENSE = re.compile(r"\.mlp\.gate$|\.indexer\.weights_proj$|(^|\.)lm_head$|\.eh_proj$")


@dataclass(frozen=True)
class StoredLinear:
    """One Linear as stored: its form, logical (out, in) shape, INT4 group size and bits."""

    name: str
    form: str
    shape: tuple[int, int]
    group_size: int | None = None  # INT4: in / weight_scale columns
    num_bits: int | None = None
    has_zero_point: bool = False
    scale_name: str | None = None  # FP8: `weight_scale` or `weight_scale_inv`


@dataclass(frozen=True)
class EngineLayer:
    """A layer a serving engine builds: a Linear (maybe fused from several stored ones) or a MoE."""

    name: str  # vLLM/SGLang prefix: `model.layers.0.self_attn.qkv_proj`, `model.layers.1.mlp.experts`
    kind: str
    shards: tuple[str, ...]  # the stored Linears it loads, in order
    is_always_dense: bool = False

    @property
    def leaf(self) -> str:
        return self.name.rpartition(".")[2]


@dataclass
class CheckpointView:
    root: Path
    config: dict  # the language model's config (Kimi K2.5+: `text_config`)
    quant: dict  # quantization_config ({} for an unquantized checkpoint)
    tensors: dict[str, TensorInfo]
    linears: dict[str, StoredLinear]
    layers: list[EngineLayer] = field(default_factory=list)
    file_config: dict = field(default_factory=dict)  # config.json as stored (a wrapper's included)
    mtp_layers: list[EngineLayer] = field(default_factory=list)  # loaded only to speculate

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    @property
    def is_mla(self) -> bool:
        return bool(self.config.get("kv_lora_rank"))

    @property
    def is_dsa(self) -> bool:
        return bool(self.config.get("index_topk"))

    @property
    def kv_scales(self) -> list[str]:
        return sorted(n for n in self.tensors if n.endswith((".k_scale", ".v_scale")))

    def moe_dims(self) -> tuple[int, int]:
        """(hidden_size, moe_intermediate_size) of the routed experts."""
        return int(self.config["hidden_size"]), int(self.config["moe_intermediate_size"])


def open_view(path: str | Path) -> CheckpointView:
    """Read config.json and every shard header of `path` (no tensor data)."""
    ckpt = Checkpoint.open(path)
    text_config = ckpt.config.get("text_config")
    config = text_config if isinstance(text_config, dict) and text_config else ckpt.config
    quant = ckpt.config.get("quantization_config") or config.get("quantization_config") or {}
    linears = _stored_linears(ckpt.tensors)
    num_layers = config.get("num_hidden_layers")  # checked by the checkpoint rules; any value reads here
    num_layers = num_layers if isinstance(num_layers, int) else 1 << 30
    view = CheckpointView(ckpt.root, config, quant, ckpt.tensors, linears, file_config=ckpt.config)
    view.layers = engine_layers([m for m in linears if not _is_mtp(m, num_layers)])
    view.mtp_layers = engine_layers([m for m in linears if _is_mtp(m, num_layers)])
    return view


def _is_mtp(module: str, num_layers: int) -> bool:
    match = _LAYER_INDEX.search(module)
    return match is not None and int(match[1]) >= num_layers


def _stored_linears(tensors: dict[str, TensorInfo]) -> dict[str, StoredLinear]:
    out: dict[str, StoredLinear] = {}
    for name, info in tensors.items():
        module, _, param = name.rpartition(".")
        if param == "weight_packed":
            out[module] = _int4(module, info, tensors)
        elif param == "weight" and is_linear_weight(name, info.shape):
            shape = (info.shape[0], info.shape[1])
            if info.dtype in FP8_CODES:
                names = (f"{module}.weight_scale", f"{module}.weight_scale_inv")
                scale = next((s for s in names if s in tensors), None)
                form = FP8_SCALE_INV if scale and scale.endswith("_inv") else FP8
                out[module] = StoredLinear(module, form, shape, scale_name=scale)
            else:
                out[module] = StoredLinear(module, DENSE, shape)
    return dict(sorted(out.items()))


def _int4(module: str, packed: TensorInfo, tensors: dict[str, TensorInfo]) -> StoredLinear:
    scale = tensors.get(f"{module}.weight_scale")
    rows, words = packed.shape[0], packed.shape[1]
    in_features = words * 8  # 4-bit: `weight_shape` holds the exact value, but as data, not header
    group = None
    if scale is not None and len(scale.shape) == 2 and scale.shape[1] > 0:
        group = in_features // scale.shape[1]
    return StoredLinear(
        module,
        INT4,
        (rows, in_features),
        group_size=group,
        num_bits=4,
        has_zero_point=f"{module}.weight_zero_point" in tensors,
        scale_name=f"{module}.weight_scale" if scale is not None else None,
    )


def engine_layers(modules: list[str]) -> list[EngineLayer]:
    """The engine's layers over stored Linear `modules`: siblings fused per `FUSED_LAYERS` (only when all
    of a fused layer's parts are stored), experts gathered into one MoE layer per `mlp.experts`."""
    present = set(modules)
    layers: dict[str, EngineLayer] = {}
    for module in modules:
        expert = _EXPERT.match(module)
        if expert:
            prev = layers.get(expert["layer"])
            shards = (*prev.shards, module) if prev else (module,)
            layers[expert["layer"]] = EngineLayer(expert["layer"], MOE, shards)
            continue
        name, parts = fused_layer(module, present)
        is_always_dense = len(parts) == 1 and _ALWAYS_DENSE.search(module) is not None
        layers[name] = EngineLayer(name, LINEAR, parts, is_always_dense)
    return sorted(layers.values(), key=lambda layer: layer.name)
