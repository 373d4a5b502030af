"""`kvq bench compress --method gptq`: kvq's layer-streamed GPTQ vs llm-compressor `oneshot` + `GPTQModifier`.

Input: the 8-layer glm4_moe bench fixture (hidden 1024, 64 routed experts top-4 + 1 shared, first layer
dense), BF16 (what `oneshot` loads). Same recipe and group size, same calibration token ids (kvq's
windows, written to a file and handed to `oneshot` as exactly those ids), same GPTQ settings. Three runs,
each a subprocess measured by `run_measured` (wall time, peak RSS of the process tree): llm-compressor
(its default routes every token through every expert for the Hessians), kvq with
`--moe-calibrate-all-experts` (the same work) and kvq's default (each expert's own routed tokens, RTN
below `--moe-min-tokens`). Also recorded: the bound kvq prints, and how many `weight_packed` nibbles
kvq (all experts) and llm-compressor share.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.table import Table

from kvq.bench.measure import Measurement, run_measured
from kvq.byte_sizes import format_bytes, parse_bytes


@dataclass(frozen=True)
class GptqBenchConfig:
    arch: str = "glm4_moe"
    num_layers: int = 8
    recipe: str = "w4a16-experts"
    num_samples: int = 32
    seq_len: int = 256
    workers: int = 2
    threads: int = 2


@dataclass(frozen=True)
class GptqRow:
    name: str
    wall_s: float
    peak_rss_bytes: int
    printed_bound_bytes: int | None  # kvq's own bound, None for llm-compressor


def printed_bound(output: str) -> int:
    """The `peak memory <= ~X` that `kvq compress` prints, in bytes."""
    found = re.search(r"peak\s+memory\s+<=\s+~([\d.]+)\s+(\w+)", output)
    if found is None:
        raise ValueError(f"no memory bound in the output: {output[-500:]}")
    return parse_bytes(found[1] + found[2], "the printed bound")


def oneshot_gptq(src: str, out: str, recipe: str, ids_path: str, group_size: int | None = None) -> None:
    """llm-compressor `oneshot` with a `GPTQModifier` of kvq's recipe (its GPTQ settings, else
    llm-compressor's defaults) on exactly the ids in `ids_path`."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from transformers import AutoModelForCausalLM

    from kvq.compress.recipe import load_recipe

    input_ids = torch.load(ids_path)
    loaded = load_recipe(recipe, group_size)
    config = loaded.quantization_config()
    # the observer and its kwargs are in the weights' QuantizationArgs (`config`), not GPTQModifier fields
    settings = loaded.gptq.modifier_fields() if loaded.gptq is not None else {}
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    batches = [
        {"input_ids": r.unsqueeze(0), "attention_mask": torch.ones_like(r).unsqueeze(0)} for r in input_ids
    ]
    oneshot(
        model=model,
        dataset=torch.utils.data.DataLoader(batches, batch_size=None),  # type: ignore[arg-type]
        recipe=GPTQModifier(config_groups=config.config_groups, ignore=config.ignore, **settings),
        num_calibration_samples=len(batches),
        max_seq_length=input_ids.shape[1],
        shuffle_calibration_samples=False,
    )
    model.save_pretrained(out, save_compressed=True)


def calibration_ids(src: Path, num_samples: int, seq_len: int, path: Path) -> str:
    """kvq's default calibration windows (seed 0), saved for `oneshot`; returns their sha256."""
    import torch

    from kvq.calibrate.calibrate_checkpoint import calibration_samples
    from kvq.calibrate.calibration_config import CalibrationConfig

    samples = calibration_samples(src, CalibrationConfig(num_samples=num_samples, seq_len=seq_len))
    torch.save(samples.input_ids, path)
    return samples.fingerprint


def shared_nibbles(a: Path, b: Path) -> float:
    """Fraction of `weight_packed` nibbles equal in two outputs (over the tensors both hold)."""
    from kvq.checkpoint.reader import Checkpoint
    from kvq.formats.pack_quantized import unpack_int4

    mine, theirs = Checkpoint.open(a), Checkpoint.open(b)
    same = total = 0
    for name in sorted(n for n in mine.tensors if n.endswith(".weight_packed") and n in theirs.tensors):
        x, y = unpack_int4(mine.read(name)), unpack_int4(theirs.read(name))
        same, total = same + int((x == y).sum()), total + x.numel()
    return same / max(1, total)


def _measured(argv: list[str], threads: int) -> Measurement:
    os.sync()
    m = run_measured(argv, env={"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
    if m.returncode != 0:
        raise SystemExit(f"{argv[:4]} failed ({m.returncode}):\n{m.output[-3000:]}")
    return m


def run_gptq_bench(config: GptqBenchConfig, work: Path) -> dict:
    from kvq.bench.calibrate import bench_fixture

    src = bench_fixture(config.arch, "bf16", config.num_layers)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ids_path = work / "ids.pt"
    fingerprint = calibration_ids(src, config.num_samples, config.seq_len, ids_path)
    py = sys.executable

    def kvq(out: Path, *extra: str) -> list[str]:
        argv = [py, "-m", "kvq", "compress", str(src), str(out), "--recipe", config.recipe]
        argv += ["--method", "gptq"]
        argv += ["--num-samples", str(config.num_samples), "--seq-len", str(config.seq_len)]
        return [*argv, "--workers", str(config.workers), "--quiet", *extra]

    def llm_compressor(out: Path) -> list[str]:
        call = f"oneshot_gptq({str(src)!r}, {str(out)!r}, {config.recipe!r}, {str(ids_path)!r})"
        return [py, "-c", f"from kvq.bench.compress_gptq import oneshot_gptq; {call}"]

    runs = {
        "llm-compressor oneshot GPTQModifier (every token to every expert)": llm_compressor,
        "kvq compress --method gptq --moe-calibrate-all-experts": lambda o: kvq(
            o, "--moe-calibrate-all-experts"
        ),
        "kvq compress --method gptq (routed tokens per expert)": kvq,
    }
    rows, outs = [], []
    for k, (name, argv_for) in enumerate(runs.items()):
        outs.append(work / f"out{k}")
        m = _measured(argv_for(outs[-1]), config.threads)
        bound = None if name.startswith("llm-compressor") else printed_bound(m.output)
        rows.append(GptqRow(name, m.wall_s, m.peak_rss_bytes, bound))
    agreement = shared_nibbles(outs[1], outs[0])
    return {
        "config": asdict(config),
        "source": str(src),
        "token_ids_sha256": fingerprint,
        "cpus": os.cpu_count(),
        "rows": [asdict(r) for r in rows],
        "nibbles_shared_with_llm_compressor": agreement,
    }


def render(report: dict) -> Table:
    rows = [GptqRow(**r) for r in report["rows"]]
    reference = rows[0]
    c = report["config"]
    table = Table(
        title=f"kvq bench compress --method gptq ({c['arch']}, {c['num_layers']} layers, "
        f"{c['num_samples']} x {c['seq_len']} tokens, recipe {c['recipe']})"
    )
    for col in ("contender", "wall s", "peak RSS", "vs llm-compressor RSS", "kvq's printed bound"):
        table.add_column(col, justify="left" if col == "contender" else "right")
    for row in rows:
        bound = "-" if row.printed_bound_bytes is None else format_bytes(row.printed_bound_bytes)
        ratio = f"{row.peak_rss_bytes / reference.peak_rss_bytes:.3f}"
        table.add_row(row.name, f"{row.wall_s:.1f}", format_bytes(row.peak_rss_bytes), ratio, bound)
    table.caption = (
        f"target: peak RSS <= 1/3 of llm-compressor's; weight_packed nibbles kvq (all experts) shares with "
        f"llm-compressor: {report['nibbles_shared_with_llm_compressor']:.4f}"
    )
    return table
