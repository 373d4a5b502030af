"""`kvq bench tp`: what one tensor-parallel rank holds and reads, measured at --tp 1 and --tp N on a
checkpoint, set beside `kvq plan`'s figures for it, then projected by the same arithmetic to GLM-5 INT4
at TP8 on H200s from the planner alone (weights per GPU, KV tokens, decode bytes per token per GPU).

Decode bytes per token (batch 1) per rank: every resident weight except the routed experts and the
embedding, top_k / n_routed_experts of the routed experts (each rank holds a slice of every expert), one
embedding row; plus the KV bytes the step reads (DSA: every index key, the latent of at most index_topk
tokens). Imports torch and kvq.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from kvq.bench.json_output import JsonOption
from kvq.byte_sizes import format_bytes
from kvq.commands.render import console

GLM5_ROUTED = (8, 256, 75, 76)  # top_k, n_routed_experts, MoE decoder layers, MoE layers with the MTP one
GLM5_INDEX_TOPK, GLM5_LAYERS = 2048, 78


def decode_weight_bytes(engine) -> int:  # noqa: ANN001  (a kvq Engine)
    """Weight bytes one rank reads per decoded token at batch 1 (see the module docstring)."""
    from kvq.runtime.models.glm4_moe import MoE

    model = engine.model
    total = sum(t.numel() * t.element_size() for t in model.tensors())
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            experts = sum(t.numel() * t.element_size() for t in layer.mlp.experts.tensors())
            total -= experts - experts * layer.mlp.gate.top_k // layer.mlp.gate.num_experts
    if not model.config.tie_word_embeddings:  # a tied embedding is the lm_head: read whole
        embed = model.embed_tokens
        total -= embed.numel() * embed.element_size() - embed[0].numel() * embed.element_size()
    return total


def _plan(args: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "kvq", "plan", *args, "--json"], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def _measure(model: Path, tp: int, tokens: int, runs: int, threads: int) -> dict:
    from kvq.runtime.config import EngineConfig
    from kvq.runtime.engine import Engine
    from kvq.runtime.kv_pool import page_bytes
    from kvq.runtime.sampling import SamplingParams

    engine = Engine(EngineConfig(model=str(model), tp=tp, kv_memory="64MiB", threads=threads, max_num_seqs=1))
    pool = engine.kv_pool
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    engine.generate([[5, 6, 7, 8]], params)  # warm
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        engine.generate([[5, 6, 7, 8]], params)
        seconds.append(time.perf_counter() - start)
    result = {
        "tp": tp,
        "read_bytes": engine.rank_read_bytes,
        "resident_bytes": engine.rank_weight_bytes,
        "kv_bytes_per_token": page_bytes(pool.layout, pool.num_layers, pool.page_size) // pool.page_size,
        "decode_weight_bytes": decode_weight_bytes(engine),
        "tokens_per_s": tokens / statistics.median(seconds),
    }
    engine.close()
    return result


def glm5_projection(config_dir: Path, tp: int = 8, context: int = 32768) -> dict:
    """GLM-5 INT4 (w4a16-experts, group 32, from GLM-5-FP8: FP8 attention kept) at `tp` on 141 GB GPUs."""
    out = _plan(
        [str(config_dir), "--recipe", "w4a16-experts", "--group-size", "32", "--tp", str(tp)]
        + ["--gpu-mem", "141GB"]
    )
    serving, kinds = out["serving"], out["plan"]["kinds"]
    top_k, num_experts, moe_layers, moe_with_mtp = GLM5_ROUTED
    routed = kinds["routed_experts"]["bytes_after"] * moe_layers // moe_with_mtp  # the MTP layer not loaded
    embed = kinds["embeddings"]["bytes_after"] // 2  # embed_tokens (one row read) and lm_head, same shape
    per_gpu = serving["weight_bytes_per_gpu"]
    decode = per_gpu - (routed - routed * top_k // num_experts) // tp - embed // tp
    fp8 = next(k for k in serving["kv"] if k["kv_cache_dtype"] == "fp8_e4m3")
    kv_read = (
        context * fp8["indexer_bytes_per_token"] + min(context, GLM5_INDEX_TOPK) * fp8["kv_bytes_per_token"]
    )
    return {
        "weight_bytes_per_gpu": per_gpu,
        "kv_tokens_fp8": fp8["tokens"],
        "kv_tokens_bf16": next(k for k in serving["kv"] if k["kv_cache_dtype"] == "bf16")["tokens"],
        "decode_weight_bytes_per_token_per_gpu": decode,
        "decode_kv_bytes_per_token_per_gpu": kv_read,
        "context": context,
    }


def bench_tp_command(
    model: Annotated[Path, typer.Argument(help="An INT4 checkpoint that splits over --tp ranks.")],
    tp: Annotated[int, typer.Option(help="Ranks of the tensor-parallel run (beside --tp 1).")] = 2,
    tokens: Annotated[int, typer.Option(help="Tokens decoded per timed run (batch 1).")] = 16,
    runs: Annotated[int, typer.Option(help="Timed runs per --tp (median).")] = 3,
    threads: Annotated[int, typer.Option(help="torch threads per rank.")] = 1,
    glm5_config: Annotated[
        Path | None,
        typer.Option(
            help="A GLM-5-FP8 config.json folder: project GLM-5 INT4 at TP8 on H200s from the plan."
        ),
    ] = None,
    json_out: JsonOption = None,
) -> None:
    """Per-rank weights, KV bytes per token and decode bytes per token at --tp 1 and --tp N, against
    `kvq plan --tp N`; with --glm5-config, the same arithmetic for GLM-5 INT4 at TP8."""
    report: dict = {"runs": [_measure(model, n, tokens, runs, threads) for n in (1, tp)]}
    report["plan_per_gpu"] = {
        n: _plan([str(model), "--tp", str(n), "--gpu-mem", "141GB"])["serving"]["weight_bytes_per_gpu"]
        for n in (1, tp)
    }
    for row in report["runs"]:
        console.print(
            f"--tp {row['tp']}: read {format_bytes(row['read_bytes'][0])} per rank (plan "
            f"{format_bytes(report['plan_per_gpu'][row['tp']])}), "
            f"resident {format_bytes(row['resident_bytes'][0])}, "
            f"KV {row['kv_bytes_per_token']} B/token, decode reads {format_bytes(row['decode_weight_bytes'])}"
            f"/token, {row['tokens_per_s']:.1f} tok/s"
        )
    if glm5_config is not None:
        report["glm5_int4_tp8"] = glm5_projection(glm5_config)
        console.print(json.dumps(report["glm5_int4_tp8"], indent=2))
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2) + "\n")
