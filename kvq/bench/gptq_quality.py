"""`kvq bench gptq`: what GPTQ buys on SmolLM2, measured with `kvq eval`, and kvq's GPTQ vs llm-compressor's.

SmolLM2-135M-Instruct (the embedded BF16 model), every Linear but lm_head to INT4 group 64, three ways:
round-to-nearest (`kvq compress --recipe w4a16-linear`), kvq's GPTQ (`--recipe w4a16-linear-gptq`:
llm-compressor's GPTQ defaults; `--recipe` picks another GPTQModifier recipe) and llm-compressor `oneshot`
+ `GPTQModifier` with the same recipe on exactly kvq's calibration token ids; with `--gptaq`, also kvq's
GPTAQ (`--method gptaq`) with the same recipe. Each is scored by `kvq eval`
against the BF16 model (BF16 KV pages: the weights alone) on two texts: the held-out split of the bundled
Wikipedia articles (never calibrated on) and news (the Lee corpus of Australian news articles in gensim,
`lee_background.cor`). Also recorded: the share of `weight_packed` nibbles kvq's and llm-compressor's GPTQ
outputs have in common, per tensor and overall.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.table import Table

from kvq.bench.compress_gptq import calibration_ids, shared_nibbles
from kvq.bench.json_output import JsonOption
from kvq.bench.measure import run_measured
from kvq.commands.field_options import GivenOptions, field_options
from kvq.commands.render import console
from kvq.paths import cache_dir
from kvq.runtime.config import option

NEWS_CORPUS = "lee_background.cor"


@dataclass(frozen=True)
class GptqQualityConfig:
    """Every setting of the benchmark; a field made by `option` is also its --field-name."""

    num_samples: int = option(64, "Calibration windows.")
    seq_len: int = option(512, "Tokens per calibration window.")
    eval_windows: int = option(16, "Windows (of 256 tokens) kvq eval scores per text.")
    threads: int = option(2, "Torch threads of every step.")
    llm_compressor: bool = option(  # the oracle; ~30 min at 16 x 512
        True,
        "Also run llm-compressor's oneshot GPTQ on the same token ids (the oracle: nibbles shared with "
        "kvq's). --no-llm-compressor: RTN and kvq's GPTQ only.",
    )
    recipe: str = option(
        "w4a16-linear-gptq", "The GPTQModifier recipe (name or file) kvq's and llm-compressor's GPTQ run."
    )
    gptaq: bool = option(  # llm-compressor has no GPTAQ
        False, "Also kvq compress --method gptaq with the same recipe (kvq-gptaq)."
    )
    group_size: int = 64
    eval_seq_len: int = 256


def news_jsonl(path: Path) -> Path:
    """gensim's Lee news corpus (one article per line) as the .jsonl `kvq eval --text` reads."""
    import importlib.util

    spec = importlib.util.find_spec("gensim")
    assert spec is not None and spec.submodule_search_locations
    corpus = Path(spec.submodule_search_locations[0]) / "test" / "test_data" / NEWS_CORPUS
    lines = [line.strip() for line in corpus.read_text(encoding="utf-8").splitlines() if line.strip()]
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return path


def _run(argv: list[str], threads: int) -> float:
    m = run_measured(argv, env={"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
    if m.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:5])} failed ({m.returncode}):\n{m.output[-3000:]}")
    console.print(f"{' '.join(argv[3:6])}: {m.wall_s:.0f} s")
    return m.wall_s


def build_outputs(config: GptqQualityConfig, src: Path, work: Path) -> dict[str, dict]:
    """The three INT4 checkpoints of `src`, with the wall time each took. A step recorded as done in
    `work/walls.json` (same settings) is not run again: an interrupted bench resumes."""
    py = sys.executable
    kvq = [py, "-m", "kvq", "compress", str(src)]
    common = ["--group-size", str(config.group_size), "--workers", "2", "--quiet"]
    gptq = ["--num-samples", str(config.num_samples), "--seq-len", str(config.seq_len)]
    names = (
        ["rtn", "kvq-gptq"] + ["llm-compressor-gptq"] * config.llm_compressor + ["kvq-gptaq"] * config.gptaq
    )
    outs = {name: work / name for name in names}
    ids_path = work / "ids.pt"
    fingerprint = calibration_ids(src, config.num_samples, config.seq_len, ids_path)
    out = str(work / "llm-compressor-gptq")
    call = f"oneshot_gptq({str(src)!r}, {out!r}, {config.recipe!r}, {str(ids_path)!r}, {config.group_size})"
    steps = {
        "rtn": [*kvq, str(outs["rtn"]), "--recipe", "w4a16-linear", *common],
        "kvq-gptq": [*kvq, str(outs["kvq-gptq"]), "--recipe", config.recipe, *common, *gptq],
        "kvq-gptaq": [
            *kvq,
            str(work / "kvq-gptaq"),
            "--recipe",
            config.recipe,
            "--method",
            "gptaq",
            *common,
            *gptq,
        ],
        "llm-compressor-gptq": [py, "-c", f"from kvq.bench.compress_gptq import oneshot_gptq; {call}"],
    }
    steps = {name: argv for name, argv in steps.items() if name in outs}
    record = work / "walls.json"
    settings = {**asdict(config), "token_ids_sha256": fingerprint}
    done = json.loads(record.read_text()) if record.exists() else {}
    walls = done.get("walls", {}) if done.get("settings") == settings else {}
    for name, argv in steps.items():
        if name in walls:
            console.print(f"{name}: done before ({walls[name]:.0f} s)")
            continue
        shutil.rmtree(outs[name], ignore_errors=True)
        walls[name] = _run(argv, config.threads)
        record.write_text(json.dumps({"settings": settings, "walls": walls}, indent=2))
    manifest = json.loads((outs["kvq-gptq"] / "kvq_manifest.json").read_text())
    assert manifest["job"]["method"]["calibration"]["token_ids_sha256"] == fingerprint
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (src / name).exists() and "llm-compressor-gptq" in outs:
            shutil.copy2(src / name, outs["llm-compressor-gptq"] / name)
    return {name: {"path": str(out), "wall_s": walls[name]} for name, out in outs.items()}


def perplexity(config: GptqQualityConfig, model: Path, text: Path | None, out: Path) -> float:
    """`kvq eval MODEL` (BF16 KV pages: the weights alone) on `text` (None: held-out Wikipedia)."""
    argv = [sys.executable, "-m", "kvq", "eval", str(model), "--json", str(out)]
    argv += ["--tasks", "text", "--kv-cache-dtype", "bf16", "--threads", str(config.threads)]
    argv += ["--num-windows", str(config.eval_windows), "--seq-len", str(config.eval_seq_len)]
    _run(argv + ([] if text is None else ["--text", str(text)]), config.threads)
    metrics = json.loads(out.read_text())["runs"][0]["metrics"]
    value = next(m["model"] for m in metrics if m["key"] == "perplexity")
    console.print(f"kvq eval {model} ({'held-out Wikipedia' if text is None else text.name}): {value:.4f}")
    return value


def run_quality_bench(config: GptqQualityConfig, work: Path) -> dict:
    from kvq.data.embedded_model import ensure_smollm2

    src = ensure_smollm2().bf16
    work.mkdir(parents=True, exist_ok=True)
    outputs = build_outputs(config, src, work)
    texts = {"wikipedia (held out)": None, "news (Lee corpus)": news_jsonl(work / "news.jsonl")}
    models = {"bf16": src} | {name: Path(output["path"]) for name, output in outputs.items()}
    results: dict[str, dict] = {}
    for t, (text_name, text) in enumerate(texts.items()):  # the same windows for every model of one text
        results[text_name] = {
            name: perplexity(config, model, text, work / f"eval-{name}-{t}.json")
            for name, model in models.items()
        }
    return {
        "config": asdict(config),
        "cpus": os.cpu_count(),
        "outputs": outputs,
        "perplexity": results,
        "nibbles_shared_kvq_vs_llm_compressor": shared_nibbles(
            Path(outputs["kvq-gptq"]["path"]), Path(outputs["llm-compressor-gptq"]["path"])
        )
        if config.llm_compressor
        else None,
    }


def render(report: dict) -> Table:
    table = Table(title="kvq bench gptq: SmolLM2 W4A16 group 64, every Linear, perplexity by kvq eval")
    for column in ("text", "weights", "perplexity", "vs BF16", "share of RTN's increase"):
        table.add_column(column, justify="left" if column in ("text", "weights") else "right")
    for text, ppl in report["perplexity"].items():
        rtn_increase = ppl["rtn"] / ppl["bf16"] - 1
        for name, value in ppl.items():
            increase = value / ppl["bf16"] - 1
            share = f"{increase / rtn_increase:.2f}" if name != "bf16" else ""
            table.add_row(text, name, f"{value:.4f}", f"{increase:+.2%}" if name != "bf16" else "", share)
    shared = report["nibbles_shared_kvq_vs_llm_compressor"]
    if shared is not None:
        table.caption = f"weight_packed nibbles shared by kvq's and llm-compressor's GPTQ: {shared:.4f}"
    return table


@field_options(GptqQualityConfig, "options")
def bench_gptq_command(*, options: GivenOptions, json_out: JsonOption = None) -> None:
    """SmolLM2 perplexity (kvq eval) of RTN, kvq's GPTQ and llm-compressor's GPTQ (and kvq's GPTAQ), on two
    kinds of text.
    Resumes: a checkpoint built before with the same settings is not built again."""
    config = GptqQualityConfig(**options.values)
    report = run_quality_bench(config, cache_dir() / "bench" / "gptq-quality-work")
    console.print(render(report))
    path = json_out or cache_dir() / "bench" / "gptq-quality.json"
    path.write_text(json.dumps(report, indent=2))
    console.print(f"results: {path}")
