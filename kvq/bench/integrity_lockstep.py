"""The cost half of `kvq bench integrity`: engines stepped in lockstep, the time spent inside each
engine's tracker, and the statistics over rounds and paired steps (see `kvq.bench.integrity`).

Only the standard library at module level; the engines come in from the caller.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvq.runtime.engine import Engine


TRACKER_METHODS = (
    "screen",
    "check",
    "guard",
    "after_step",
    "on_take",
    "on_attach",
    "on_seal",
    "on_deallocate",
    "on_free",
    "on_release_of_free_page",
    "on_unhash",
)


class TrackerTimer:
    """Seconds spent inside an engine's tracker: every method the engine and block manager call (bench
    only: wrapped on the tracker instance, re-wrapped by `watch` after `Engine.reset_kv`), and the slots
    its step checks covered (per checked batch: its block-table entries, rows and new tokens)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.slots = 0

    def watch(self, engine: Engine) -> None:
        tracker = engine.tracker
        if tracker is None:
            return
        for name in TRACKER_METHODS:
            method = getattr(tracker, name)

            def timed(*args: object, _method=method, _name=name, **kwargs: object) -> object:  # type: ignore[no-untyped-def]
                if _name == "check":
                    batch = args[1]
                    rows = batch.block_tables.shape[0]  # type: ignore[attr-defined]
                    self.slots += batch.block_tables.numel() + rows + batch.positions.shape[0]  # type: ignore[attr-defined]
                start = time.perf_counter()
                try:
                    return _method(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start

            setattr(tracker, name, timed)


def lockstep_round(
    engines: dict[str, Engine], timers: dict[str, TrackerTimer], prompts: list[list[int]], max_tokens: int
) -> dict[str, dict]:
    """Every prompt queued on every engine, then the engines step in turn (the order rotating each
    step) until all are done, so load that comes and goes on the machine hits every group alike. Per
    group: tokens/s of its own step time, its step times, time inside the tracker, aborts."""
    from kvq.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for engine in engines.values():
        for prompt in prompts:
            engine.add_request(prompt, params)
    step_s: dict[str, list[float]] = {group: [] for group in engines}
    generated = dict.fromkeys(engines, 0)
    tracker_before = {group: timer.seconds for group, timer in timers.items()}
    slots_before = {group: timer.slots for group, timer in timers.items()}
    aborts_before = {group: engine.stats.integrity_aborts for group, engine in engines.items()}
    order = list(engines)
    while active := [g for g in order if engines[g].has_unfinished_requests()]:
        for group in active:
            start = time.perf_counter()
            outputs = engines[group].step()
            step_s[group].append(time.perf_counter() - start)
            generated[group] += sum(len(o.token_ids) for o in outputs if o.finished)
        order = order[1:] + order[:1]
    return {
        group: {
            "tok_s": generated[group] / sum(step_s[group]),
            "step_s": step_s[group],
            "tracker_s": timers[group].seconds - tracker_before[group],
            "slots_checked": timers[group].slots - slots_before[group],
            "aborts": engine.stats.integrity_aborts - aborts_before[group],
        }
        for group, engine in engines.items()
    }


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per group: median tok/s over rounds; median over all steps of the step's time / the same step of
    `off`; P50 and P95 over all steps of all rounds; the tracker's share of step time; ratios to `off`."""
    summary = {}
    off_runs = runs["off"]
    for group, group_runs in runs.items():
        steps = sorted(t for run in group_runs for t in run["step_s"])
        paired = [
            t / t_off
            for run, off_run in zip(group_runs, off_runs, strict=True)
            # strict=False: a group whose request was stopped can finish its round in fewer steps
            for t, t_off in zip(run["step_s"], off_run["step_s"], strict=False)
        ]
        quantiles = statistics.quantiles(steps, n=20, method="inclusive")
        tracker_s = sum(run["tracker_s"] for run in group_runs)
        slots = sum(run["slots_checked"] for run in group_runs)
        summary[group] = {
            "tok_s": statistics.median(run["tok_s"] for run in group_runs),
            "step_vs_off": statistics.median(paired),
            "p50_step_ms": quantiles[9] * 1e3,
            "p95_step_ms": quantiles[18] * 1e3,
            "tracker_ms_per_step": tracker_s / len(steps) * 1e3,
            "tracker_share": tracker_s / sum(steps),
            "slots_per_step": slots / len(steps),
            "tracker_us_per_slot": tracker_s / slots * 1e6 if slots else 0.0,
            "aborts": sum(run["aborts"] for run in group_runs),
        }
    off = summary["off"]
    for values in summary.values():
        values["tok_s_vs_off"] = values["tok_s"] / off["tok_s"]
        values["p95_vs_off"] = values["p95_step_ms"] / off["p95_step_ms"]
    return summary
