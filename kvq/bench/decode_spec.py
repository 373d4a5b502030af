"""`kvq bench decode --model glm_moe_dsa --speculative mtp`: MTP speculative decoding on the MLA bench
fixture, decoded with and without it in one run.

The fixture (`kvq.fixtures` size "bench", BF16, one MTP layer; random weights) and a copy whose MTP
`shared_head.head` is fit to the model's own greedy continuation of the bench prompt (`kvq.fixtures.mtp_fit`:
a predicting-well draft, as a trained MTP layer is; the random one drafts noise). Contenders at concurrency
1: no speculation, the random MTP layer and the fitted one, each drafting K tokens; fp32 reference mode (the
fit's greedy tokens are fp32's). Decode tok/s by (N - 1) / (t(N) - t(1)) as in `kvq bench decode`,
contenders taking turns, each turn on an engine of its own, freed before the next is built (one model
resident at a time). From the engine's counters over each turn's N-token run: acceptance, target forwards
(prefill and verification steps of the model) per token, and per decode step the milliseconds of the
model's forward (one position, or K + 1 verified) and of the MTP layer's; times are medians over the
turns. Built once under `kvq.paths.cache_dir()/bench`. Imports torch and kvq.runtime, kvq.fixtures inside
the builders.
"""

from __future__ import annotations

import gc
import json
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.table import Table

from kvq.bench.decode_speed import FixtureDecodeConfig, decode_tok_s
from kvq.paths import cache_dir

if TYPE_CHECKING:
    from kvq.runtime.engine import Engine

PLAIN = "no speculation"


@dataclass(frozen=True)
class SpecBenchConfig(FixtureDecodeConfig):
    num_speculative_tokens: int = 1
    fit_steps: int = 300  # Adam steps of the fitted MTP head
    dtype: str = "float32"


@dataclass
class SpecRun:
    """One contender: decode speed, and what its last N-token run drafted, accepted and ran."""

    tok_s: float
    tok_s_runs: list[float]
    speedup: float = 1.0  # tok/s over no speculation's, same run
    acceptance_rate: float = 0.0  # accepted / draft tokens
    mean_accepted_length: float = 1.0  # tokens per verification: 1 + accepted / drafts
    accepted_per_pos: list[int] = field(default_factory=list)
    target_forwards_per_token: float = 1.0  # prefill + verification forwards of the model / tokens
    target_forward_ms: float = 0.0  # per decode step: the model's forward (1 position, or K + 1 verified)
    mtp_ms: float = 0.0  # per decode step: the MTP layer's forwards (K drafts, then over what was accepted)


@dataclass
class Counters:
    """An engine's counters (`EngineStats`, and `SpecStats` with --speculative) at one moment."""

    num_steps: int
    forward_seconds: float
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    is_spec: bool = False
    mtp_seconds: float = 0.0
    verify_seconds: float = 0.0


@dataclass
class SpecBenchResult:
    config: dict
    runs: dict[str, SpecRun] = field(default_factory=dict)


def spec_models(config: SpecBenchConfig, root: Path | None = None, size: str = "bench") -> dict[str, Path]:
    """The `size` fixture with one MTP layer (random) and its copy with a fitted MTP head, built once."""
    from kvq.fixtures.checkpoint_fixtures import build_fixture
    from kvq.fixtures.mtp_fit import build_predictive_mtp

    root = root or cache_dir() / "bench"
    random_path = root / f"glm_moe_dsa-{size}-bf16-mtp"
    if not (random_path / "config.json").is_file():
        build_fixture("glm_moe_dsa", "bf16", random_path, size=size, num_mtp_layers=1)
    tag = f"p{config.prompt_tokens}-n{config.new_tokens}-s{config.fit_steps}"
    fitted_path = root / f"glm_moe_dsa-{size}-bf16-mtp-fit-{tag}"
    if not fitted_path.is_dir():
        prompt = bench_prompt(random_path, config.prompt_tokens)
        build_predictive_mtp(random_path, fitted_path, [prompt], config.new_tokens, config.fit_steps)
    return {"random": random_path, "fitted": fitted_path}


def bench_prompt(path: Path, num_tokens: int) -> list[int]:
    """The bench's one prompt: `num_tokens` random ids (the fit and the timed runs read the same)."""
    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    return torch.randint(3, vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(1)).tolist()


def spec_engine(path: Path, config: SpecBenchConfig, speculative: str | None) -> Engine:
    """One contender's engine (concurrency 1, `config.dtype`)."""
    from kvq.runtime.config import EngineConfig
    from kvq.runtime.engine import Engine

    return Engine(
        EngineConfig(
            model=str(path),
            dtype=config.dtype,
            threads=config.threads,
            page_size=config.page_size,
            kv_memory="64MiB",
            max_num_seqs=1,
            speculative=speculative,
            num_speculative_tokens=config.num_speculative_tokens,
        )
    )


def counters(engine: Engine) -> Counters:
    """The engine's counters a contender's record is the difference of."""
    now = Counters(engine.stats.num_steps, engine.stats.forward_seconds)
    if engine.proposer is None:
        return now
    stats = engine.proposer.stats
    return replace(
        now,
        num_drafts=stats.num_drafts,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted=stats.num_accepted_tokens,
        accepted_per_pos=list(stats.accepted_per_pos),
        is_spec=True,
        mtp_seconds=stats.mtp_seconds,
        verify_seconds=stats.verify_seconds,
    )


def one_turn(path: Path, config: SpecBenchConfig, speculative: str | None) -> tuple[float, SpecRun]:
    """One repeat of one contender on an engine of its own (freed on return: one model resident at a
    time): its decode tok/s and the record of its N-token run, less its 1-token run (the prefill)."""
    from kvq.runtime.sampling_params import SamplingParams

    engine = spec_engine(path, config, speculative)
    prompt = bench_prompt(path, config.prompt_tokens)
    seen: dict[int, tuple[Counters, Counters]] = {}

    def generate(n: int) -> object:
        before = counters(engine)
        out = engine.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
        seen[n] = (before, counters(engine))
        return out

    tok_s = decode_tok_s({"turn": generate}, 1, config.new_tokens, 1)["turn"][0]
    return tok_s, spec_run(seen[1], seen[config.new_tokens], config.new_tokens)


def run_spec_bench(config: SpecBenchConfig, paths: dict[str, Path]) -> SpecBenchResult:
    """No speculation vs the random and the fitted MTP layer (`paths` from `spec_models`), in one run:
    contenders take turns within every repeat, each on a fresh engine freed before the next is built."""
    torch.set_num_threads(config.threads)
    k = config.num_speculative_tokens
    contenders = {
        PLAIN: (paths["random"], None),
        **{f"mtp K={k}, {kind} MTP layer": (paths[kind], "mtp") for kind in ("random", "fitted")},
    }
    turns: dict[str, list[tuple[float, SpecRun]]] = {name: [] for name in contenders}
    for _ in range(config.repeats):
        for name, (path, speculative) in contenders.items():
            turns[name].append(one_turn(path, config, speculative))
            gc.collect()  # the engine's weights go before the next contender's load
    result = SpecBenchResult(config=asdict(config))
    for name, runs in turns.items():  # counts are the same every turn (greedy); times: their medians
        result.runs[name] = run = runs[-1][1]
        run.tok_s_runs = [tok_s for tok_s, _ in runs]
        run.tok_s = statistics.median(run.tok_s_runs)
        run.target_forward_ms = statistics.median(r.target_forward_ms for _, r in runs)
        run.mtp_ms = statistics.median(r.mtp_ms for _, r in runs)
    for run in result.runs.values():
        run.speedup = run.tok_s / result.runs[PLAIN].tok_s
    return result


def spec_run(prefill: tuple[Counters, Counters], full: tuple[Counters, Counters], num_tokens: int) -> SpecRun:
    """A contender's record from its counters around a 1-token run (`prefill`) and a `num_tokens` run."""
    (p0, p1), (f0, f1) = prefill, full
    steps, drafts = f1.num_steps - f0.num_steps, f1.num_drafts - f0.num_drafts
    draft_tokens, accepted = f1.num_draft_tokens - f0.num_draft_tokens, f1.num_accepted - f0.num_accepted
    decode_steps = steps - (p1.num_steps - p0.num_steps)
    decode_forward_s = f1.forward_seconds - f0.forward_seconds - (p1.forward_seconds - p0.forward_seconds)
    return SpecRun(
        tok_s=0.0,
        tok_s_runs=[],
        acceptance_rate=accepted / draft_tokens if draft_tokens else 0.0,
        mean_accepted_length=1.0 + accepted / drafts if drafts else 1.0,
        accepted_per_pos=[
            a - (f0.accepted_per_pos[p] if p < len(f0.accepted_per_pos) else 0)
            for p, a in enumerate(f1.accepted_per_pos)
        ],
        target_forwards_per_token=steps / num_tokens,
        target_forward_ms=1e3
        * (f1.verify_seconds - f0.verify_seconds if f1.is_spec else decode_forward_s)
        / max(decode_steps, 1),
        mtp_ms=1e3 * (f1.mtp_seconds - f0.mtp_seconds) / max(decode_steps, 1),
    )


def render_spec(result: SpecBenchResult) -> Table:
    c = result.config
    table = Table(
        title=f"kvq bench decode --model glm_moe_dsa --speculative mtp (bench fixture, {c['dtype']}, "
        f"concurrency 1, {c['new_tokens']} tokens)"
    )
    for column in ("contender", "tok/s", "vs no speculation", "acceptance", "mean accepted length"):
        table.add_column(column, justify="left" if column == "contender" else "right")
    for column in ("target forwards / token", "ms / target forward", "MTP ms / step", "accepted by position"):
        table.add_column(column, justify="right")
    for name, run in result.runs.items():
        is_plain = name == PLAIN
        table.add_row(
            name,
            f"{run.tok_s:.2f}",
            f"{run.speedup:.2f}x",
            "-" if is_plain else f"{run.acceptance_rate:.2f}",
            "-" if is_plain else f"{run.mean_accepted_length:.2f}",
            f"{run.target_forwards_per_token:.2f}",
            f"{run.target_forward_ms:.0f}",
            "-" if is_plain else f"{run.mtp_ms:.0f}",
            "-" if is_plain else ", ".join(map(str, run.accepted_per_pos)),
        )
    return table
