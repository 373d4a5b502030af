"""Broken MTP releases, made from a good checkpoint in a temporary directory: the MTP shard left out of the
weight index, and `ignore` lists that contradict the MTP tensors. What `kvq check` must name."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

INDEX = "model.safetensors.index.json"


def mtp_shard_not_indexed(src: Path, dst: Path, layer: int) -> Path:
    """`src` with layer `layer`'s tensors moved to their own `model-mtp.safetensors`, which the index
    does not list (the file is there; loaders that go through the index never see it)."""
    shutil.copytree(src, dst)
    index = json.loads((dst / INDEX).read_text())
    prefix = f"model.layers.{layer}."
    mtp = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(dst / shard))
        moved = {n: t for n, t in tensors.items() if n.startswith(prefix)}
        if moved:
            mtp.update(moved)
            save_file({n: t for n, t in tensors.items() if n not in moved}, str(dst / shard))
    save_file(mtp, str(dst / "model-mtp.safetensors"))
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if not n.startswith(prefix)}
    (dst / INDEX).write_text(json.dumps(index))
    return dst


def edit_ignore(src: Path, dst: Path, edit) -> Path:
    """`src` with `edit(ignore) -> ignore` applied to its quantization_config's ignore list."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    quant = config["quantization_config"]
    quant["ignore"] = edit(list(quant["ignore"]))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def mtp_entries_by_name(ignore: list[str]) -> list[str]:
    """kvq's MTP `re:` entries spelled out by checkpoint name (`model.layers.3.self_attn.q_a_proj`), as
    a by-name ignore list writes them: vLLM matches those, SGLang's NextN decoder does not."""
    out = []
    for entry in ignore:
        match = re.fullmatch(r"re:\^model\\\.\(layers\\\.(\d+)\|decoder\)\\\.(.*)\((.*)\)\$", entry)
        if match is None:
            out.append(entry)
            continue
        parent = match[2].replace("\\.", ".")
        out += [f"model.layers.{match[1]}.{parent}{leaf}" for leaf in match[3].split("|")]
    return out


def whole_mtp_layer_ignored(layer: int):
    """An edit adding `re:model.layers.{layer}.*` (the MTP layer "kept in BF16") to `ignore`."""

    def edit(ignore: list[str]) -> list[str]:
        return [*ignore, rf"re:^model\.layers\.{layer}\..*"]

    return edit
