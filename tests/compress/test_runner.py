"""kvq compress end to end: output layout, exact size prediction, resume after a kill, and bad input."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from kvq.checkpoint.reader import Checkpoint, block_size
from kvq.compress.manifest import MANIFEST_NAME
from kvq.compress.recipe import RECIPES_DIR, load_recipe
from kvq.compress.runner import prepare, run
from kvq.compress.size_plan import size_plan
from kvq.compress.tensor_plan import build_plan
from kvq.errors import KvqError
from kvq.fixtures.tiny_models import tiny_config
from tests.compress.conftest import FIXTURES, compress, compress_argv
from tests.compress.synthetic import EXPERT, fp8_expert, random_checkpoint, read_json, snapshot, write_shards


@pytest.mark.parametrize(("arch", "fmt"), FIXTURES)
def test_plan_predicts_the_written_size_exactly(compressed, tiny_checkpoint, arch, fmt):
    ckpt = Checkpoint.open(tiny_checkpoint(arch, fmt))
    plan = build_plan(ckpt.tensors, load_recipe("w4a16-experts"), block_size(ckpt))
    predicted = size_plan(plan, 0).output_file_bytes
    written = sum(p.stat().st_size for p in compressed(arch, fmt).glob("*.safetensors"))
    assert predicted == written  # the issue asks for 0.1%; the layout is computed to the byte


def test_output_layout(compressed, tiny_checkpoint):
    src, out = tiny_checkpoint("glm_moe_dsa", "fp8-block"), compressed("glm_moe_dsa", "fp8-block")
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(
        p.name for p in src.glob("*.safetensors")
    )
    for side in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (out / side).read_bytes() == (src / side).read_bytes()
    config = read_json(out / "config.json")
    qc = config.pop("quantization_config")
    assert config == {k: v for k, v in read_json(src / "config.json").items() if k != "quantization_config"}
    assert qc["format"] == "mixed-precision" and qc["quant_method"] == "compressed-tensors"
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert qc["config_groups"]["group_1"]["weights"]["block_structure"] == [128, 128]
    assert "lm_head" in qc["ignore"] and "model.layers.1.mlp.gate" in qc["ignore"]
    index = read_json(out / "model.safetensors.index.json")
    ckpt = Checkpoint.open(out)
    assert index["weight_map"] == {n: i.file.name for n, i in sorted(ckpt.tensors.items())}
    assert index["metadata"]["total_size"] == ckpt.tensor_bytes
    manifest = read_json(out / MANIFEST_NAME)
    assert manifest["complete"] and manifest["kvq_version"] and manifest["recipe"]["name"] == "w4a16-experts"
    for name, record in manifest["shards"].items():
        assert (out / name).stat().st_size == record["bytes"]
        assert snapshot(out)[name] == record["sha256"]
    assert not list(out.glob("*.kvq-tmp"))


def test_rerun_keeps_finished_shards_and_foreign_manifest_keys(tiny_checkpoint, tmp_path):
    out = compress(tiny_checkpoint("glm4_moe", "bf16"), tmp_path / "out")
    manifest = read_json(out / MANIFEST_NAME)
    manifest["kv_calibration"] = {"scales": "kv_scales.safetensors"}  # what kvq calibrate adds later
    (out / MANIFEST_NAME).write_text(__import__("json").dumps(manifest))
    before = snapshot(out)
    report = run(prepare(tiny_checkpoint("glm4_moe", "bf16"), out, load_recipe("w4a16-experts")), 2)
    assert not report.shards_written and len(report.shards_resumed) == 3
    assert snapshot(out) == before


def test_tampered_shard_is_redone(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama", "bf16")
    out = compress(src, tmp_path / "out", "w4a16-linear")
    before = snapshot(out)
    shard = sorted(out.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(data)
    report = run(prepare(src, out, load_recipe("w4a16-linear")), 2)
    assert report.shards_written == [shard.name]
    assert snapshot(out) == before


def many_shard_source(root: Path) -> Path:
    config = tiny_config("glm4_moe", num_layers=4)
    src = random_checkpoint(root, config, "fp8-block", max_shard_bytes=256 * 1024)
    assert len(list(src.glob("*.safetensors"))) >= 12
    return src


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default. A shell runs a background job (`make test &`)
    with SIGINT ignored, which exec passes on, and Python then leaves Ctrl-C ignored: the CLI ran to the
    end and exited 0 (the SIGINT case failed in background runs only)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_after_first_shard(src: Path, out: Path, sig: signal.Signals, workers: int = 1) -> int:
    """Run `kvq compress` in its own session; once a shard is recorded and under its final name, send `sig`
    to the whole session."""
    argv = compress_argv(src, out, "w4a16-experts", "--workers", str(workers), "--quiet")
    proc = subprocess.Popen(
        argv,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_default_sigint,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        manifest = out / MANIFEST_NAME
        recorded = read_json(manifest).get("shards", {}) if manifest.exists() else {}
        if any((out / name).exists() for name in recorded):
            break
        time.sleep(0.005)
    os.killpg(proc.pid, sig)  # the whole session, as a terminal does: CLI, forkserver and worker
    return proc.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "workers"),
    [(signal.SIGKILL, 1), (signal.SIGINT, 1), (signal.SIGKILL, 2)],  # 12 shards on 2 workers: cut in parts
    ids=["SIGKILL", "SIGINT", "SIGKILL-parts"],
)
def test_interrupted_run_resumes_to_identical_bytes(tmp_path, sig, workers):
    src = many_shard_source(tmp_path / "src")
    source_before = snapshot(src)
    reference = compress(src, tmp_path / "reference", workers=1)
    out = tmp_path / "out"
    returncode = interrupt_after_first_shard(src, out, sig, workers)
    assert returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 130)
    manifest = read_json(out / MANIFEST_NAME)
    assert not manifest["complete"] and 1 <= len(manifest["shards"]) < 12
    done, expected = snapshot(out), snapshot(reference)
    for name in (p.name for p in out.glob("*.safetensors")):  # whatever has a final name is complete
        assert done[name] == expected[name]
    if sig == signal.SIGINT:  # a clean stop also removes its temporary file
        assert not list(out.glob("*.kvq-tmp"))
    report = run(prepare(src, out, load_recipe("w4a16-experts")), 2)
    assert report.shards_resumed and report.shards_written
    assert snapshot(out) == snapshot(reference)
    assert snapshot(src) == source_before


# --- bad input: a clear error naming the file or tensor, nothing complete-looking left, SRC untouched ---


def expect_error(src: Path, out: Path, match: str, recipe: str = "w4a16-experts") -> None:
    before = snapshot(src)
    with pytest.raises(KvqError, match=match):
        run(prepare(src, out, load_recipe(recipe)), 2)
    assert snapshot(src) == before
    if out.exists() and out != src:
        assert not list(out.glob("*.kvq-tmp"))
        manifest = read_json(out / MANIFEST_NAME) if (out / MANIFEST_NAME).exists() else {"shards": {}}
        assert {p.name for p in out.glob("*.safetensors")} <= set(manifest["shards"])
        assert not (out / "config.json").exists()


def copy_fixture(tiny_checkpoint, tmp_path: Path, arch: str = "glm4_moe", fmt: str = "fp8-block") -> Path:
    return Path(shutil.copytree(tiny_checkpoint(arch, fmt), tmp_path / "src"))


def test_truncated_shard(tiny_checkpoint, tmp_path):
    src = copy_fixture(tiny_checkpoint, tmp_path)
    shard = sorted(src.glob("*.safetensors"))[1]
    os.truncate(shard, shard.stat().st_size - 1000)
    expect_error(src, tmp_path / "out", f"{shard.name}: tensor .* ends at byte .* truncated or corrupt")


def test_corrupt_header(tiny_checkpoint, tmp_path):
    src = copy_fixture(tiny_checkpoint, tmp_path)
    shard = sorted(src.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:12] = b"!!!!"
    shard.write_bytes(data)
    expect_error(src, tmp_path / "out", f"{shard.name}: header is not valid JSON")


def test_missing_weight_scale_inv(tmp_path):
    weight, _ = fp8_expert()
    src = write_shards(tmp_path / "src", {"model.safetensors": {f"{EXPERT}.weight": weight}})
    expect_error(src, tmp_path / "out", f"'{EXPERT}.weight' has no '{EXPERT}.weight_scale_inv' .* restore")


def test_scale_shape_mismatch(tmp_path):
    weight, scale_inv = fp8_expert()
    src = write_shards(
        tmp_path / "src",
        {
            "model.safetensors": {f"{EXPERT}.weight": weight},
            "other.safetensors": {f"{EXPERT}.weight_scale_inv": scale_inv[:1]},
        },
    )
    expect_error(
        src, tmp_path / "out", r"other.safetensors: .*weight_scale_inv' has shape \[1, 2\], expected \[2, 2\]"
    )


@pytest.mark.parametrize("where", ["weight_bf16", "weight_fp8", "scale_inv"])
def test_nan_or_inf_is_named_and_nothing_incomplete_is_left(tmp_path, where):
    weight, scale_inv = fp8_expert()
    good = {
        f"model.layers.1.mlp.experts.1.up_proj.{k}": v
        for k, v in zip(("weight", "weight_scale_inv"), fp8_expert(seed=1), strict=True)
    }
    if where == "weight_bf16":
        bad = {f"{EXPERT}.weight": torch.randn(256, 256).bfloat16()}
        bad[f"{EXPERT}.weight"][3, 7] = float("inf")
        match = (
            r"'model.layers.1.mlp.experts.0.up_proj.weight' holds NaN/Inf \(first at \[row, column\] \[3, 7\]"
        )
    elif where == "weight_fp8":
        weight.view(torch.uint8)[5, 9] = 0x7F
        bad = {f"{EXPERT}.weight": weight, f"{EXPERT}.weight_scale_inv": scale_inv}
        match = r"FP8 tensor 'model.layers.1.mlp.experts.0.up_proj.weight' holds NaN \(first at .* \[5, 9\]"
    else:
        scale_inv[1, 0] = float("nan")
        bad = {f"{EXPERT}.weight": weight, f"{EXPERT}.weight_scale_inv": scale_inv}
        match = (
            r"'model.layers.1.mlp.experts.0.up_proj.weight_scale_inv' holds NaN/Inf \(first at block \[1, 0\]"
        )
    src = write_shards(tmp_path / "src", {"model-1.safetensors": bad, "model-2.safetensors": good})
    expect_error(src, tmp_path / "out", match)


def test_unknown_recipe_key(tiny_checkpoint, tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(
        (RECIPES_DIR / "w4a16-experts.yaml")
        .read_text()
        .replace("      ignore:", "      smoothing_strength: 0.8\n      ignore:")
    )
    with pytest.raises(
        KvqError,
        match=r"mine.yaml: .*QuantizationModifier: unknown recipe key\(s\) "
        r"smoothing_strength; .* remove them",
    ):
        load_recipe(str(recipe))


def test_out_inside_src(tiny_checkpoint, tmp_path):
    src = copy_fixture(tiny_checkpoint, tmp_path)
    expect_error(src, src / "int4", "OUT is inside SRC")
    expect_error(src, src, "OUT is inside SRC")


def test_out_holding_a_different_job(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("glm4_moe", "bf16")
    out = compress(src, tmp_path / "out")
    before = snapshot(out)
    with pytest.raises(
        KvqError, match="already holds a different job .*'w4a16-experts'.* choose another OUT"
    ):
        prepare(src, out, load_recipe("w4a16-linear"))
    with pytest.raises(KvqError, match="already holds a different job") as refused:
        prepare(src, out, load_recipe("w4a16-experts", 64))
    assert "differs in recipe.group_size" in str(refused.value)  # the field named, not only the jobs
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(KvqError, match="other: not empty .* holds no kvq_manifest.json"):
        prepare(src, tmp_path / "other", load_recipe("w4a16-experts"))
    assert snapshot(out) == before


def test_cli_prints_one_line_and_exits_2(tmp_path):
    argv = compress_argv(tmp_path / "nope", tmp_path / "o", "w4a16-experts")
    result = subprocess.run(argv, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "no such directory" in result.stderr
