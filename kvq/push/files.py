"""Which files of a kvq output `kvq push` sends: the checkpoint, not the folder.

The checkpoint is the files its manifest lists (every shard, the KV scales file) and the index names,
plus the known model metadata at the top of the folder: config, index, manifest, generation config,
tokenizer files, chat template, license and card. Any other file goes only when an `--include PATTERN`
(a glob over the path relative to the folder, e.g. `sub/*.md`) matches it; a dotfile, or anything in
a dot-folder, never goes (`.env`, `.git/`, `.cache/`). Imports the standard library and kvq only.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvq.calibrate.scales_record import FILE_KEY
from kvq.checkpoint.write import TMP_SUFFIX
from kvq.errors import KvqError

METADATA_NAMES = frozenset(
    {
        "config.json",
        "model.safetensors.index.json",
        "kvq_manifest.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
        "README.md",
        "LICENSE",
        "LICENSE.md",
        "LICENSE.txt",
    }
)


@dataclass(frozen=True)
class FileSelection:
    """What `kvq push` sends and what it leaves out, as paths relative to the folder (posix)."""

    files: list[str]
    left_out: list[str]  # not part of the checkpoint and no --include asked for it
    dotfiles: list[str]  # never sent


def select_files(
    root: Path, manifest: dict, weight_map: dict[str, str], include: Sequence[str] = ()
) -> FileSelection:
    """Split `root`'s files into the ones to send and the ones left out; `KvqError` for an `--include`
    pattern that matches nothing it could send."""
    root = Path(root)
    found = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    checkpoint = _checkpoint_files(manifest, weight_map)
    files, left_out, dotfiles = [], [], []
    for name in found:
        if any(part.startswith(".") for part in name.split("/")):
            dotfiles.append(name)
        elif name in checkpoint or (name in METADATA_NAMES and not name.endswith(TMP_SUFFIX)):
            files.append(name)
        elif any(fnmatch.fnmatchcase(name, pattern) for pattern in include):
            files.append(name)
        else:
            left_out.append(name)
    for pattern in include:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in files):
            raise KvqError(
                f"--include {pattern!r} matches no file of {root} that can be uploaded (paths are relative "
                "to it, e.g. 'sub/*.md'; dotfiles are never uploaded)"
            )
    return FileSelection(files, left_out, dotfiles)


def _checkpoint_files(manifest: dict, weight_map: dict[str, str]) -> set[str]:
    names = set(manifest.get("shards") or {}) | set(weight_map.values())
    scales = manifest.get(FILE_KEY)
    if scales:
        names.add(scales["name"])
    return names
