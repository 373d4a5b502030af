"""One shard job alone: pure (same job, same bytes); a full disk inside a worker is reported cleanly."""

from __future__ import annotations

import errno
import os

import pytest

from kvq.checkpoint.reader import Checkpoint, block_size
from kvq.compress import shard_files
from kvq.compress.jobs import ShardJob
from kvq.compress.recipe import load_recipe
from kvq.compress.shard_job import run_shard_job
from kvq.compress.tensor_plan import build_plan
from kvq.errors import KvqError


def first_job(src, out_dir) -> ShardJob:
    ckpt = Checkpoint.open(src)
    plan = build_plan(ckpt.tensors, load_recipe("w4a16-experts"), block_size(ckpt))
    shard, tasks = sorted(plan.shards.items())[-1]
    return ShardJob(shard, out_dir / shard, tuple(tasks), plan.group_size, plan.block)


def test_same_job_same_bytes(tiny_checkpoint, tmp_path):
    job = first_job(tiny_checkpoint("glm4_moe", "fp8-block"), tmp_path)
    seen = []
    first = run_shard_job(job, seen.append)
    assert not job.out_path.exists()  # finished under its temporary name: the parent publishes it
    shard_files.publish(job.out_path)
    data = job.out_path.read_bytes()
    assert sum(seen) == job.input_bytes and first.file_bytes == len(data)
    assert set(first.weight_map.values()) == {job.shard} and not first.is_resumed
    os.remove(job.out_path)
    again = run_shard_job(job)
    shard_files.publish(job.out_path)
    assert job.out_path.read_bytes() == data and again.sha256 == first.sha256


def test_recorded_shard_is_verified_not_redone(tiny_checkpoint, tmp_path):
    job = first_job(tiny_checkpoint("glm4_moe", "bf16"), tmp_path)
    result = run_shard_job(job)
    shard_files.publish(job.out_path)
    mtime = job.out_path.stat().st_mtime_ns
    resumed = run_shard_job(
        ShardJob(
            *[getattr(job, f) for f in ("shard", "out_path", "tasks", "group_size", "block")],
            (result.file_bytes, result.sha256),
        )
    )
    assert resumed.is_resumed and job.out_path.stat().st_mtime_ns == mtime


def test_disk_full_in_a_worker(tiny_checkpoint, tmp_path, monkeypatch):
    job = first_job(tiny_checkpoint("glm4_moe", "fp8-block"), tmp_path)
    calls = {"n": 0}
    real_pwrite = os.pwrite

    def pwrite(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > 20:  # the disk fills up part-way through the shard
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(
        shard_files.os, "posix_fallocate", lambda *a: None
    )  # a filesystem that cannot reserve
    monkeypatch.setattr(shard_files.os, "pwrite", pwrite)
    with pytest.raises(KvqError, match=f"{job.shard}: disk full while writing '.*' .*free space on"):
        run_shard_job(job)
    assert os.listdir(tmp_path) == []
