"""Cutting shards into parts: only when there are too few shards per worker, every task once and in order,
and the output byte-identical to one job per shard; the torch fallback gives the same bytes as the C path."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvq.checkpoint.write import tmp_path as temporary
from kvq.compress import native
from kvq.compress.jobs import PartJob, ShardJob
from kvq.compress.parts import Parts, cut
from kvq.compress.recipe import load_recipe
from kvq.compress.runner import prepare
from kvq.compress.shard_job import run_shard_job
from tests.compress.conftest import compress
from tests.compress.synthetic import snapshot


def shard_jobs(src: Path, out: Path) -> list[ShardJob]:
    return prepare(src, out, load_recipe("w4a16-experts")).jobs


def test_cut_covers_every_task_once_in_order_with_even_bytes(tiny_checkpoint, tmp_path) -> None:
    job = max(shard_jobs(tiny_checkpoint("glm4_moe", "fp8-block"), tmp_path), key=lambda j: len(j.tasks))
    largest_task = max(t.input_bytes for t in job.tasks)
    for parts in (2, 3, 7, len(job.tasks)):
        pieces = cut(job, parts)
        assert len(pieces) == parts and all(piece.tasks for piece in pieces)
        assert tuple(t for piece in pieces for t in piece.tasks) == job.tasks
        assert max(piece.input_bytes for piece in pieces) <= job.input_bytes / parts + largest_task
        names = [name for piece in pieces for name in piece.layout.tensors]
        assert sorted(names) == sorted(job.layout.tensors)  # every output written by exactly one part
        assert all(
            piece.layout.offsets[n] == job.layout.offsets[n] for piece in pieces for n in piece.layout.offsets
        )


def test_only_few_shards_are_cut_and_recorded_shards_never(tiny_checkpoint, tmp_path) -> None:
    jobs = shard_jobs(tiny_checkpoint("glm4_moe", "fp8-block"), tmp_path)
    assert Parts(jobs, 1).work == jobs  # one worker: nothing to balance
    cut_work = Parts(jobs, 2).work
    assert any(isinstance(item, PartJob) for item in cut_work)
    assert sum(item.input_bytes for item in cut_work) == sum(job.input_bytes for job in jobs)
    many = [dataclasses.replace(jobs[0], shard=f"s{i}") for i in range(16)]
    assert Parts(many, 2).work == many  # 8 jobs per worker already
    recorded = [dataclasses.replace(job, recorded=(1, "0" * 64)) for job in jobs]
    assert Parts(recorded, 2).work == recorded  # verified or redone whole


def test_cut_shards_give_the_same_bytes_as_whole_ones(tiny_checkpoint, tmp_path) -> None:
    src = tiny_checkpoint("glm_moe_dsa", "fp8-block")
    assert any(isinstance(i, PartJob) for i in Parts(shard_jobs(src, tmp_path / "probe"), 3).work)
    whole = compress(src, tmp_path / "whole", workers=1)
    parts = compress(src, tmp_path / "parts", workers=3)
    assert snapshot(parts) == snapshot(whole)


def test_torch_fallback_gives_the_c_quantizers_bytes(tiny_checkpoint, tmp_path, monkeypatch) -> None:
    assert native.is_available()
    for fmt in ("fp8-block", "bf16"):
        job = shard_jobs(tiny_checkpoint("glm4_moe", fmt), tmp_path / fmt)[-1]
        job.out_path.parent.mkdir()
        c_result = run_shard_job(job)
        c_bytes = temporary(job.out_path).read_bytes()
        monkeypatch.setattr(native, "_int4", None)  # a build without a C compiler
        torch_result = run_shard_job(job)
        monkeypatch.undo()
        assert temporary(job.out_path).read_bytes() == c_bytes
        assert torch_result.sha256 == c_result.sha256


def test_bf16_stored_scales_take_the_torch_path_to_the_same_tensors(tiny_checkpoint, tmp_path) -> None:
    """A `weight_scale_inv` stored as BF16 (the C kernel takes fp32 only): same tensors as fp32 scales."""
    src = tiny_checkpoint("glm4_moe", "fp8-block")
    outputs = {}
    for dtype in (torch.float32, torch.bfloat16):
        copy = tmp_path / f"src-{dtype}"
        shutil.copytree(src, copy)
        for shard in sorted(copy.glob("*.safetensors")):
            tensors = load_file(shard)
            for name in [n for n in tensors if n.endswith("weight_scale_inv")]:
                tensors[name] = tensors[name].bfloat16().to(dtype)  # bf16-exact either way
            save_file(tensors, shard, metadata={"format": "pt"})
        out = compress(copy, tmp_path / f"out-{dtype}")
        outputs[dtype] = {k: v for p in sorted(out.glob("*.safetensors")) for k, v in load_file(p).items()}
    fp32, bf16 = outputs[torch.float32], outputs[torch.bfloat16]
    assert fp32.keys() == bf16.keys() and all(torch.equal(fp32[k], bf16[k]) for k in fp32)
