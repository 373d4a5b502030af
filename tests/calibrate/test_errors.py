"""Bad input gives one clear error and leaves the checkpoint byte-for-byte as it was."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvq.calibrate.calibrate_checkpoint import calibrate
from kvq.calibrate.calibration_config import CalibrationConfig
from kvq.errors import KvqError
from tests.calibrate.conftest import writable
from tests.conftest import TinyCheckpoint
from tests.test_cli_errors import assert_one_line_error, run_kvq


def snapshot(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _text(tmp: Path, name: str, content: str | bytes) -> Path:
    path = tmp / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


DATASETS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "empty": (lambda t: _text(t, "empty.txt", "\n  \n\n"), "no text found"),
    "too short": (
        lambda t: _text(t, "short.txt", "A few words of text.\n\nAnd a second document."),
        "lower --num-samples or",
    ),
    "missing": (lambda t: t / "nope.jsonl", "no such dataset file"),
    "directory": (lambda t: (t / "dir.txt").mkdir() or t / "dir.txt", "is a directory"),
    "not utf-8": (lambda t: _text(t, "latin.txt", "caf\xe9 au lait".encode("latin-1")), "is not UTF-8"),
    "bad jsonl": (
        lambda t: _text(t, "bad.jsonl", '{"text": "ok"}\n{"text": \n'),
        "bad.jsonl:2: not valid JSON",
    ),
    "no text field": (lambda t: _text(t, "nofield.jsonl", '{"body": "x"}\n'), "string 'text' field"),
    "wrong extension": (lambda t: _text(t, "data.csv", "a,b\n"), "must be .txt"),
}


@pytest.mark.parametrize("case", list(DATASETS))
def test_bad_dataset(tiny_checkpoint: TinyCheckpoint, tmp_path: Path, case: str) -> None:
    root = writable(tiny_checkpoint("llama", "bf16"), tmp_path)
    make, message = DATASETS[case]
    before = snapshot(root)
    with pytest.raises(KvqError, match=message):
        calibrate(root, CalibrationConfig(dataset=make(tmp_path), num_samples=4, seq_len=64))
    assert snapshot(root) == before


def _edit_config(root: Path, **changes: object) -> None:
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, **changes}))


def _scale_in_weight_shard(root: Path) -> None:
    shard = root / "model-00001-of-00003.safetensors"
    index = json.loads((root / "model.safetensors.index.json").read_text())
    tensors = load_file(shard)
    tensors["model.layers.0.self_attn.k_scale"] = torch.ones(1, dtype=torch.bfloat16)
    save_file(tensors, shard)
    index["weight_map"]["model.layers.0.self_attn.k_scale"] = shard.name
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def _drop_tensor(root: Path, name: str) -> None:
    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = root / index["weight_map"].pop(name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard)
    index_path.write_text(json.dumps(index))


CHECKPOINTS: dict[str, tuple[str, Callable[[Path], None], dict, str]] = {
    "seq_len past positions": (
        "llama",
        lambda r: None,
        {"seq_len": 5000},
        "exceeds the model's max_position_emb",
    ),
    "no attention layers": (
        "llama",
        lambda r: _edit_config(r, num_hidden_layers=0),
        {},
        "no attention layers",
    ),
    "layer without attention": (
        "llama",
        lambda r: _edit_config(r, num_hidden_layers=3),
        {},
        "layer 2 has no model.layers.2.self_attn",
    ),
    "per-head MLA": ("glm_moe_dsa", lambda r: None, {"strategy": "attn_head"}, "use --strategy tensor"),
    "scales in weight shards": ("llama", _scale_in_weight_shard, {}, "already stores KV scales"),
    "missing expert": (
        "glm4_moe",
        lambda r: _drop_tensor(r, "model.layers.1.mlp.experts.3.up_proj.weight"),
        {},
        r"layer 1 stores no tensor for mlp\.experts\.gate_up_proj\[3\]\.up",
    ),
    "no tokenizer": (
        "llama",
        lambda r: [(r / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")],
        {},
        "cannot load the tokenizer",
    ),
    "unknown quant method": (
        "llama",
        lambda r: _edit_config(r, quantization_config={"quant_method": "gptq"}),
        {},
        "quant_method 'gptq'",
    ),
}


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_bad_checkpoint(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path, small_dataset: Path, case: str
) -> None:
    arch, damage, settings, message = CHECKPOINTS[case]
    root = writable(tiny_checkpoint(arch, "bf16"), tmp_path)
    damage(root)
    before = snapshot(root)
    config = {"num_samples": 4, "seq_len": 64, **settings}
    with pytest.raises(KvqError, match=message):
        calibrate(root, CalibrationConfig(dataset=small_dataset, **config))
    assert snapshot(root) == before


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"num_samples": 0}, "--num-samples must be at least 1"),
        ({"seq_len": 1}, "--seq-len must be at least 2"),
        ({"strategy": "channel"}, "--strategy 'channel' is unknown"),
    ],
)
def test_bad_settings(settings: dict, message: str) -> None:
    with pytest.raises(KvqError, match=message):
        CalibrationConfig(**settings)


def test_cli_one_line_errors(tiny_checkpoint: TinyCheckpoint, tmp_path: Path) -> None:
    root = writable(tiny_checkpoint("llama", "bf16"), tmp_path)
    before = snapshot(root)
    assert_one_line_error(run_kvq("calibrate", str(root), "--seq-len", "9000"), "--seq-len 9000", "4096")
    assert_one_line_error(
        run_kvq("calibrate", str(root), "--dataset", str(tmp_path / "missing.txt")),
        "missing.txt",
        "no such dataset file",
    )
    assert snapshot(root) == before
