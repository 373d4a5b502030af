"""`kvq bench decode --model glm_moe_dsa --speculative mtp`: MTP speculative decoding on the MLA bench
fixture, decoded with and without it in one run.

The fixture (`kvq.fixtures` size "bench", BF16, one MTP layer; random weights) and a copy whose MTP
`shared_head.head` is fit to the model's own greedy continuation of the bench prompt (`kvq.fixtures.mtp_fit`:
a predicting-well draft, as a trained MTP layer is; the random one drafts noise). Contenders at concurrency
1: no speculation, the random MTP layer and the fitted one, each drafting K tokens; fp32 reference mode (the
fit's greedy tokens are fp32's). Decode tok/s by (N - 1) / (t(N) - t(1)) as in `kvq bench decode`,
contenders taking turns, median; acceptance from the engine's `SpecStats` and target forwards (prefill and
verification steps of the model) per token over the last N-token run of each. Built once under
`kvq.paths.cache_dir()/bench`. Imports torch and kvq.runtime, kvq.fixtures inside the builders.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.table import Table

from kvq.bench.decode_speed import Generate, decode_tok_s
from kvq.paths import cache_dir

PLAIN = "no speculation"


@dataclass(frozen=True)
class SpecBenchConfig:
    threads: int = 2
    repeats: int = 3
    new_tokens: int = 16
    num_speculative_tokens: int = 1
    prompt_tokens: int = 96  # > index_topk (64): the indexer selects at every step
    page_size: int = 16
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


def spec_generate(path: Path, config: SpecBenchConfig, speculative: str | None) -> tuple[Generate, Callable]:
    """(generate(n) of the bench prompt, greedy; a reading of the engine's counters) for one contender."""
    from kvq.runtime.config import EngineConfig
    from kvq.runtime.engine import Engine
    from kvq.runtime.sampling import SamplingParams

    engine = Engine(
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
    prompt = bench_prompt(path, config.prompt_tokens)

    def counters() -> tuple[int, int, int, int, list[int]]:
        stats = engine.proposer.stats if engine.proposer is not None else None
        if stats is None:
            return engine.stats.num_steps, 0, 0, 0, []
        drafted = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        return engine.stats.num_steps, *drafted, list(stats.accepted_per_pos)

    return lambda n: engine.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True)), counters


def run_spec_bench(config: SpecBenchConfig, paths: dict[str, Path]) -> SpecBenchResult:
    """No speculation vs the random and the fitted MTP layer (`paths` from `spec_models`), in one run."""
    torch.set_num_threads(config.threads)
    built = {
        PLAIN: spec_generate(paths["random"], config, None),
        **{f"mtp K={config.num_speculative_tokens}, {kind} MTP layer": (
            spec_generate(paths[kind], config, "mtp")
        ) for kind in ("random", "fitted")},
    }  # fmt: skip
    last: dict[str, tuple[tuple, tuple]] = {}  # counters before and after the last N-token run

    def recorded(name: str) -> Generate:
        generate, counters = built[name]

        def run(n: int) -> object:
            before = counters()
            out = generate(n)
            if n == config.new_tokens:
                last[name] = (before, counters())
            return out

        return run

    runs = decode_tok_s({name: recorded(name) for name in built}, 1, config.new_tokens, config.repeats)
    result = SpecBenchResult(config=asdict(config))
    for name, tok_s_runs in runs.items():
        before, after = last[name]
        result.runs[name] = spec_run(tok_s_runs, before, after, config.new_tokens)
    plain = result.runs[PLAIN].tok_s
    for run in result.runs.values():
        run.speedup = run.tok_s / plain
    return result


def spec_run(tok_s_runs: list[float], before: tuple, after: tuple, num_tokens: int) -> SpecRun:
    """A contender's record from its tok/s and its counters (steps, drafts, draft tokens, accepted, accepted
    per position) before and after one `num_tokens` run."""
    steps, drafts, draft_tokens, accepted = (a - b for a, b in zip(after[:4], before[:4], strict=True))
    per_pos = [a - (before[4][p] if p < len(before[4]) else 0) for p, a in enumerate(after[4])]
    return SpecRun(
        tok_s=statistics.median(tok_s_runs),
        tok_s_runs=tok_s_runs,
        acceptance_rate=accepted / draft_tokens if draft_tokens else 0.0,
        mean_accepted_length=1.0 + accepted / drafts if drafts else 1.0,
        accepted_per_pos=per_pos,
        target_forwards_per_token=steps / num_tokens,
    )


def render_spec(result: SpecBenchResult) -> Table:
    c = result.config
    table = Table(
        title=f"kvq bench decode --model glm_moe_dsa --speculative mtp (bench fixture, {c['dtype']}, "
        f"concurrency 1, {c['new_tokens']} tokens)"
    )
    for column in ("contender", "tok/s", "vs no speculation", "acceptance", "mean accepted length"):
        table.add_column(column, justify="left" if column == "contender" else "right")
    table.add_column("target forwards / token", justify="right")
    table.add_column("accepted by position", justify="right")
    for name, run in result.runs.items():
        is_plain = name == PLAIN
        table.add_row(
            name,
            f"{run.tok_s:.2f}",
            f"{run.speedup:.2f}x",
            "-" if is_plain else f"{run.acceptance_rate:.2f}",
            "-" if is_plain else f"{run.mean_accepted_length:.2f}",
            f"{run.target_forwards_per_token:.2f}",
            "-" if is_plain else ", ".join(map(str, run.accepted_per_pos)),
        )
    return table
