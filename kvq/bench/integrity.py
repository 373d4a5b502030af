"""`kvq bench integrity`: what the checked KV pool (`--kv-integrity`) costs, and what it catches.

1. Cost: four engines, one per group (off, tags, full, and a second off), the same workload on each,
   run in lockstep (the engines take turns step by step, the order rotating) so load that comes and goes
   on a shared machine hits all alike: `concurrency` requests of `prompt_tokens` (the first
   `shared_prefix_tokens` shared, so prefix pages are attached), `max_tokens` each, fresh token ids every
   round. Every round the groups move on to the next engine (`Engine.reset_kv`: fresh bookkeeping over
   the same weights and pool), so over 4k rounds each group runs on each engine equally often and what
   differs between engine instances (where their weights and pages lie in memory) cancels. Per group:
   throughput (generated tokens / the group's own step time, median over rounds); each step's time over
   the same step of `off` (the engines are at the same step of the same schedule), median over every
   step; P95 step time over all steps of all rounds; and the time spent inside the tracker (every hook
   and the check) as a share of step time: the integrity work itself, free of machine noise, and per slot
   checked (block-table entries, rows and new tokens of each checked batch), which shows whether the
   tracker's host time grows faster than the slots it checks as concurrency rises. Ratios are
   against `off`; off-2 / off shows the noise floor, which is what "off is indistinguishable from an
   engine without the tracker" can mean at run time.
2. Catch (`--drill`, in `integrity_drill`): every fault of `kvq.drill.faults` in the lowest
   mode that should catch it, on fresh fp32 engines (batch-invariant tokens): caught, who was stopped,
   whether a stopped request was read after the fault, whether everyone else's tokens match a fault-free
   run; and `--random-faults` slips drawn at random (`kvq.drill.random_faults`: which primitive, request,
   page, slot and offset), each classified caught / harmless / missed / leaked / read late / crashed.
Imports torch, typer, rich and kvq.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import torch
import typer
from rich.table import Table

from kvq.bench.integrity_drill import drill_rows, drill_table, random_fault_rows, random_fault_table
from kvq.bench.integrity_lockstep import TrackerTimer, lockstep_round, summarize
from kvq.bench.json_output import JsonOption, write_json
from kvq.byte_sizes import SIZE_HELP
from kvq.commands.field_options import GivenOptions, field_options
from kvq.commands.render import console
from kvq.drill.workload import drill_engine
from kvq.errors import KvqError
from kvq.runtime.config import option

if TYPE_CHECKING:
    from kvq.runtime.engine import Engine

GROUPS = {"off": "off", "tags": "tags", "full": "full", "off-2": "off"}  # group -> --kv-integrity mode


@dataclass(frozen=True)
class IntegrityBenchConfig:
    """Every setting of the benchmark; a field made by `option` is also its --field-name."""

    concurrency: int = option(64, "Requests queued at once per run.")
    rounds: int = option(  # a multiple of 4: every group runs on every engine equally often
        8,
        "Timed lockstep rounds after one warm-up round; a multiple of 4 puts each group on each engine "
        "equally often.",
    )
    max_tokens: int = option(32, "Tokens generated per request.")
    prompt_tokens: int = option(48, "Prompt length (the first --shared-prefix-tokens shared by all).")
    shared_prefix_tokens: int = option(32, "Prompt tokens every request shares.")
    threads: int = option(2, "torch threads.")
    kv_memory: str = option("256MiB", f"KV pool of each engine, e.g. 256MiB. {SIZE_HELP}")
    drill: bool = option(True, "Also inject every fault and report what was caught.")
    random_faults: int = option(  # kvq.drill.random_faults
        40, "With --drill: this many faults drawn at random (seeds 0..N-1), in tags mode."
    )
    page_size: int = 16

    def __post_init__(self) -> None:
        is_bad = min(self.concurrency, self.rounds, self.prompt_tokens) < 1 or self.max_tokens < 2  # P95
        if is_bad or not 0 <= self.shared_prefix_tokens <= self.prompt_tokens:
            raise KvqError(
                "need concurrency, rounds, prompt_tokens >= 1, max_tokens >= 2 and 0 <= shared_prefix_tokens "
                f"<= prompt_tokens; got {self.concurrency}, {self.rounds}, {self.max_tokens}, "
                f"{self.prompt_tokens}, {self.shared_prefix_tokens}"
            )


@dataclass
class IntegrityBenchResult:
    config: dict
    model: str
    runs: dict[str, list[dict]] = field(default_factory=dict)  # group -> one entry per timed round
    summary: dict[str, dict] = field(default_factory=dict)  # group -> medians, P95, ratios vs off
    drill: list[dict] = field(default_factory=list)
    random_faults: list[dict] = field(default_factory=list)


def make_prompts(config: IntegrityBenchConfig, vocab_size: int, round_index: int) -> list[list[int]]:
    """`concurrency` prompts sharing their first `shared_prefix_tokens`; fresh ids for every round."""
    rng = random.Random(round_index)
    high = min(vocab_size, 32_000)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, high) for _ in range(n)]

    shared = ids(config.shared_prefix_tokens)
    return [
        shared + ids(config.prompt_tokens - config.shared_prefix_tokens) for _ in range(config.concurrency)
    ]


def make_engine(model: Path, config: IntegrityBenchConfig, mode: str, **kwargs: object) -> Engine:
    from kvq.runtime.config import EngineConfig
    from kvq.runtime.engine import Engine

    engine_config = EngineConfig(
        model=str(model),
        threads=config.threads,
        page_size=config.page_size,
        kv_memory=config.kv_memory,
        max_num_seqs=max(config.concurrency, 8),
        kv_integrity=mode,
        **kwargs,  # type: ignore[arg-type]
    )
    return Engine(engine_config)


def cost_runs(model: Path, config: IntegrityBenchConfig) -> dict[str, list[dict]]:
    """The lockstep rounds (after one untimed warm-up round), the groups rotating over the engines. The
    pools are sized as `off`'s; a checked group's slot stamps come on top (`reset_kv` adds them), so every
    group runs over the same pages."""
    engines = [make_engine(model, config, "off") for _ in GROUPS]
    timers = {group: TrackerTimer() for group in GROUPS}
    vocab_size = engines[0].model.config.vocab_size
    runs: dict[str, list[dict]] = {group: [] for group in GROUPS}
    for round_index in range(config.rounds + 1):
        placed = {}
        for offset, group in enumerate(GROUPS):
            engine = engines[(offset + round_index) % len(engines)]
            engine.reset_kv(GROUPS[group])
            timers[group].watch(engine)
            placed[group] = engine
        prompts = make_prompts(config, vocab_size, round_index)
        round_runs = lockstep_round(placed, timers, prompts, config.max_tokens)
        if round_index > 0:
            for group, run in round_runs.items():
                runs[group].append(run)
    return runs


def run_bench(config: IntegrityBenchConfig, model: Path) -> IntegrityBenchResult:
    torch.set_num_threads(config.threads)
    result = IntegrityBenchResult(config=asdict(config), model=str(model))
    runs = cost_runs(model, config)
    result.summary = summarize(runs)
    result.runs = {
        group: [
            {k: v for k, v in run.items() if k != "step_s"} | {"num_steps": len(run["step_s"])} for run in rs
        ]
        for group, rs in runs.items()
    }
    if config.drill:
        # the drill's faults are timed for its own engine (page size, pool, batch): the tests' drill engine
        fp32_engine = lambda mode: drill_engine(model, mode)  # noqa: E731
        result.drill = drill_rows(fp32_engine)
        result.random_faults = random_fault_rows(fp32_engine, config.random_faults)
    return result


def render(result: IntegrityBenchResult) -> list[Table]:
    config = result.config
    table = Table(
        title=f"kvq bench integrity: concurrency {config['concurrency']}, {config['max_tokens']} tokens "
        f"each, "
        f"{config['rounds']} lockstep rounds ({Path(result.model).name})"
    )
    columns = (
        "group", "tok/s", "vs off", "step vs off", "P50 ms", "P95 ms", "vs off", "tracker ms", "share",
        "slots/step", "us/slot",
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "group" else "right")
    for group, s in result.summary.items():
        table.add_row(
            group,
            f"{s['tok_s']:.1f}",
            f"{s['tok_s_vs_off']:.4f}",
            f"{s['step_vs_off']:.4f}",
            f"{s['p50_step_ms']:.1f}",
            f"{s['p95_step_ms']:.1f}",
            f"{s['p95_vs_off']:.4f}",
            f"{s['tracker_ms_per_step']:.3f}",
            f"{100 * s['tracker_share']:.2f}%",
            f"{s['slots_per_step']:.0f}",
            f"{s['tracker_us_per_slot']:.3f}",
        )
    tables = [table]
    if result.drill:
        tables.append(drill_table(result.drill))
    if result.random_faults:
        tables.append(random_fault_table(result.random_faults))
    return tables


@field_options(IntegrityBenchConfig, "options")
def bench_integrity_command(
    model: Annotated[
        Path | None, typer.Option(help="Checkpoint directory (default: the embedded SmolLM2-135M, BF16).")
    ] = None,
    *,
    options: GivenOptions,
    json_out: JsonOption = None,
) -> None:
    """Throughput and P95 step latency of --kv-integrity off / tags / full (interleaved, as ratios to off),
    the check's own share of step time, and a fault drill."""
    config = IntegrityBenchConfig(**options.values)
    if model is None:
        from kvq.data.embedded_model import ensure_smollm2

        model = ensure_smollm2().bf16
    result = run_bench(config, model)
    for table in render(result):
        console.print(table)
    write_json(result, json_out)
