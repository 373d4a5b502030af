"""The compress pool: progress through shared per-job slots adds up to every byte of input, a worker
takes up the threads the parent offers when fewer jobs than workers remain, and the process tree stays
under the memory bound `kvq compress` prints."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvq.compress import pool
from kvq.compress.forkserver import worker_context
from kvq.compress.pool import threads_per_worker
from kvq.compress.recipe import load_recipe
from kvq.compress.runner import prepare, run
from tests.compress.conftest import compress_argv


def test_threads_per_worker_splits_the_cores_over_what_can_still_run() -> None:
    assert threads_per_worker(cpus=16, workers=4, unfinished_jobs=100) == 4
    assert threads_per_worker(cpus=16, workers=4, unfinished_jobs=3) == 5
    assert threads_per_worker(cpus=16, workers=4, unfinished_jobs=1) == 16  # a one-file model
    assert threads_per_worker(cpus=2, workers=8, unfinished_jobs=8) == 1
    assert threads_per_worker(cpus=2, workers=2, unfinished_jobs=0) == 2


def test_progress_adds_up_to_the_input_bytes(tiny_checkpoint, tmp_path: Path) -> None:
    job = prepare(tiny_checkpoint("glm4_moe", "fp8-block"), tmp_path / "out", load_recipe("w4a16-experts"))
    assert len(job.jobs) > 1
    seen: list[int] = []
    run(job, workers=2, progress=seen.append)
    assert sum(seen) == job.input_bytes and all(n >= 0 for n in seen)


def test_a_worker_takes_up_the_offered_threads_between_tensors(tiny_checkpoint, tmp_path: Path) -> None:
    job = prepare(tiny_checkpoint("llama", "bf16"), tmp_path / "out", load_recipe("w4a16-experts")).jobs[0]
    (tmp_path / "out").mkdir()
    ctx = worker_context()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        pool._done_bytes, pool._threads = ctx.RawArray(ctypes.c_int64, 3), ctx.RawValue(ctypes.c_int, 2)
        result = pool._run_in_worker(job, 1)  # in this process: the worker's side alone
        assert torch.get_num_threads() == 2
        assert list(pool._done_bytes) == [0, job.input_bytes, 0] and result.file_bytes > 0
    finally:
        torch.set_num_threads(before)
        pool._done_bytes = pool._threads = None


def test_peak_memory_stays_under_the_printed_bound(tiny_checkpoint, tmp_path):
    from kvq.bench.measure import run_measured
    from kvq.compress.runner import peak_rss_bound

    src, out = tiny_checkpoint("glm4_moe", "fp8-block"), tmp_path / "out"
    bound = peak_rss_bound(prepare(src, out, load_recipe("w4a16-experts")).plan, 2)
    argv = compress_argv(src, out, "w4a16-experts", "--workers", "2", "--quiet")
    measured = run_measured(argv)  # the whole process tree, every 50 ms
    assert measured.returncode == 0, measured.output
    assert 0 < measured.peak_rss_bytes <= bound
