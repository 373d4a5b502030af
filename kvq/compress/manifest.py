"""`kvq_manifest.json`: what job produced an output directory, and the size and sha256 of every shard written.

The job identity (recipe, source fingerprint, kvq version) decides whether a re-run may resume in a
directory; finished shards are recorded as they complete, so a killed run loses at most the shards in
flight. The file is rewritten atomically and keys kvq compress does not own (`kv_calibration`, ...) are kept.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvq import __version__
from kvq.checkpoint.reader import CONFIG_NAME, INDEX_NAME, Checkpoint, read_json
from kvq.checkpoint.write import write_json_atomic

MANIFEST_NAME = "kvq_manifest.json"


def source_fingerprint(ckpt: Checkpoint) -> str:
    """sha256 over config.json, the index, and every shard's name, size and header bytes (not the data)."""
    digest = hashlib.sha256()
    for name in (CONFIG_NAME, INDEX_NAME):
        path = ckpt.root / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.exists() else b"") + b"\0")
    for name, header in sorted(ckpt.shards.items()):
        with open(header.file, "rb") as f:
            head = f.read(header.header_bytes)
        digest.update(f"{name}\0{header.file_bytes}\0".encode() + head)
    return digest.hexdigest()


def job_identity(recipe_identity: dict, fingerprint: str, target: str) -> dict:
    return {
        "recipe": recipe_identity,
        "source_fingerprint": fingerprint,
        "target": target,
        "kvq_version": __version__,
    }


def read_manifest(out: Path) -> dict | None:
    path = Path(out) / MANIFEST_NAME
    return read_json(path, "kvq manifest") if path.exists() else None


def write_manifest(out: Path, updates: dict) -> dict:
    """Merge `updates` into the manifest (other keys kept) and write it atomically; return the result."""
    manifest = read_manifest(out) or {}
    manifest.update(updates)
    write_json_atomic(manifest, Path(out) / MANIFEST_NAME)
    return manifest


def describe_identity(identity: dict) -> str:
    recipe = identity.get("recipe", {})
    method = identity.get("method") or {"name": "rtn"}
    tokens = (method.get("calibration") or {}).get("token_ids_sha256")
    described = method["name"] + (f" (calibration tokens {tokens[:12]})" if tokens else "")
    return (
        f"recipe {recipe.get('name')!r} (group {recipe.get('group_size')}), method {described}, target "
        f"{identity.get('target')}, source fingerprint "
        f"{str(identity.get('source_fingerprint'))[:12]}, kvq {identity.get('kvq_version')}"
    )


def differing_fields(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The dotted names of the fields two job identities disagree on (e.g. `recipe.ignore`)."""
    fields = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            fields += differing_fields(a, b, f"{prefix}{key}.")
        elif a != b:
            fields.append(f"{prefix}{key}")
    return fields


def canonical(data: object) -> str:
    return json.dumps(data, sort_keys=True)
