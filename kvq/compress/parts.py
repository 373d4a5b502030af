"""Cutting shards into part jobs, so that every worker has work until the end of a run.

With only a few shards per worker (a one-file model; 3 shards on 2 workers), one job per shard leaves
workers idle while the last shards finish: on the 3-shard bench fixture with 2 workers the third shard ran
alone for a third of the run. `Parts` cuts such shards into `PartJob`s of about equal input bytes, so a
run has about `JOBS_PER_WORKER` jobs per worker. The parent creates each cut shard's temporary file
(`create_files`), the parts fill it on whichever workers are free, and once the last part of a shard is
written `Parts.done` hands back its `CommitJob` (fsync and sha256 in a worker), whose outcome
`Parts.result` turns into the shard's `ShardResult`. A shard an earlier run recorded is never cut: it is
verified (and, if it does not match, redone) as one job.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import accumulate, pairwise

from kvq.compress.jobs import CommitJob, Committed, PartJob, ShardJob, ShardResult, Work
from kvq.compress.shard_files import create_shard_file

JOBS_PER_WORKER = 8


class Parts:
    """`work`: the jobs to run, with the larger shards cut into parts when there are too few to share."""

    def __init__(self, jobs: Sequence[ShardJob], workers: int) -> None:
        self.work: list[Work] = []
        self._cut: dict[str, ShardJob] = {}
        self._left: Counter[str] = Counter()
        few = 1 < workers and len(jobs) < JOBS_PER_WORKER * workers
        target = sum(job.input_bytes for job in jobs) / (JOBS_PER_WORKER * workers) if few else 0
        for job in jobs:
            parts = min(len(job.tasks), round(job.input_bytes / target)) if target else 1
            if job.recorded is not None or parts <= 1:
                self.work.append(job)
            else:
                self._cut[job.shard] = job
                self._left[job.shard] = parts
                self.work.extend(cut(job, parts))

    def create_files(self) -> None:
        """Create the temporary file of every shard that was cut, before any of its parts runs."""
        for job in self._cut.values():
            create_shard_file(job.out_path, job.layout)

    def done(self, shard: str) -> CommitJob | None:
        """Record that a part of `shard` is written; the shard's `CommitJob` once it was the last."""
        self._left[shard] -= 1
        return CommitJob(shard, self._cut[shard].out_path) if self._left[shard] == 0 else None

    def result(self, committed: Committed) -> ShardResult:
        return self._cut[committed.shard].result(committed.sha256)


def cut(job: ShardJob, parts: int) -> list[PartJob]:
    """`job`'s tasks as `parts` consecutive runs of about equal input bytes (each at least one task)."""
    ends = list(accumulate(task.input_bytes for task in job.tasks))
    total, bounds = ends[-1], [0]
    for k in range(1, parts):
        # the first task boundary at or past k/parts of the bytes, leaving one task for each later part
        stop = next(i + 1 for i, end in enumerate(ends) if end * parts >= total * k)
        bounds.append(min(max(stop, bounds[-1] + 1), len(job.tasks) - (parts - k)))
    bounds.append(len(job.tasks))
    return [
        PartJob(
            job.shard,
            job.out_path,
            job.tasks[start:stop],
            job.layout.subset(out.name for task in job.tasks[start:stop] for out in task.outputs),
            job.group_size,
            job.block,
        )
        for start, stop in pairwise(bounds)
    ]
