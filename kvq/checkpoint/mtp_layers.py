"""Where a checkpoint's MTP / NextN layers sit and how vLLM and SGLang name their modules when they load
them to speculate. Names and config only; imports nothing heavy.

DeepSeek-V3/R1 and GLM-5.x store `num_nextn_predict_layers` MTP layers as `model.layers.{N + i}.` after
the N decoder layers. vLLM's DeepSeekMTP (vllm/model_executor/models/deepseek_mtp.py) builds each one's
decoder layer under that same prefix, so quantization_config entries written for it apply as written.
SGLang's NextN (python/sglang/srt/models/deepseek_nextn.py) builds the decoder layer as `model.decoder`
and renames the quantization config by a static mapper written for DeepSeek-R1's layer 61 only (SGLang
PR #34906, open): for any other N an entry naming `model.layers.{N}.<module>` misses `model.decoder.<module>`.
"""

from __future__ import annotations

import re

from kvq.checkpoint.config_sizes import num_mtp_layers

SGLANG_NEXTN_PREFIX = "model.decoder."
SGLANG_RENAMED_LAYER = 61  # the one MTP layer index SGLang main's NextN quant-config mapper knows
# The MTP layer's own modules besides its decoder layer (DeepSeek-V3 README_WEIGHTS.md).
MTP_OWN_MODULES = ("enorm", "hnorm", "eh_proj", "shared_head.norm")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def mtp_layer_indexes(config: dict) -> range:
    """The layer indexes of the MTP layers `config` (the language model's fields) declares."""
    num_layers = config.get("num_hidden_layers")
    if not isinstance(num_layers, int):
        return range(0)
    return range(num_layers, num_layers + num_mtp_layers(config))


def mtp_layer_of(module: str, num_layers: int) -> int | None:
    """The MTP layer index of `module` (`model.layers.{i}.…` with i >= num_layers), else None."""
    match = _LAYER.match(module)
    return int(match[1]) if match and int(match[1]) >= num_layers else None


def sglang_nextn_name(module: str) -> str:
    """The name SGLang's NextN model gives an MTP decoder-layer module: `model.layers.78.self_attn.o_proj`
    -> `model.decoder.self_attn.o_proj`."""
    match = _LAYER.match(module)
    assert match is not None, module
    return SGLANG_NEXTN_PREFIX + match[2]


def sglang_renamed_entry(entry: str) -> str:
    """A quantization_config ignore / target entry as SGLang main's NextN mapper rewrites it."""
    return entry.replace(f"model.layers.{SGLANG_RENAMED_LAYER}.", SGLANG_NEXTN_PREFIX)


def mtp_ignore_entries(modules: list[str]) -> list[str]:
    """`re:` ignore entries matching MTP-layer `modules` under both names the engines use (vLLM's
    `model.layers.{N}.…`, SGLang's `model.decoder.…`), one per parent module."""
    leaves: dict[tuple[str, str], set[str]] = {}
    for module in modules:
        match = _LAYER.match(module)
        assert match is not None, module
        parent, _, leaf = match[2].rpartition(".")
        leaves.setdefault((match[1], parent), set()).add(leaf)
    out = []
    for (layer, parent), names in sorted(leaves.items()):
        inner = re.escape(f"{parent}.") if parent else ""
        out.append(rf"re:^model\.(layers\.{layer}|decoder)\.{inner}({'|'.join(sorted(names))})$")
    return out
