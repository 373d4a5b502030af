"""The `kvq bench decode` command: its options, and the dispatch to the SmolLM2 bench (`kvq.bench.decode`),
the MLA bench (`decode_mla`), its speculative-decoding comparison (`decode_spec`) or the tensor-parallel
one (`decode_tp`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from kvq.bench.decode import DecodeBenchConfig, run_bench
from kvq.bench.decode_render import render
from kvq.bench.json_output import JsonOption, write_json
from kvq.commands.engine_options import engine_options
from kvq.commands.field_options import GivenOptions, field_options
from kvq.commands.render import console
from kvq.errors import KvqError
from kvq.runtime.config import option
from kvq.smollm2_int4 import ensure_smollm2_int4


@dataclass(frozen=True)
class DecodeOptions:
    """`kvq bench decode`'s own options (each field is its --field-name); the engine's come from
    `EngineConfig`. Defaults are `DecodeBenchConfig`'s (the SmolLM2 bench)."""

    threads: int = option(DecodeBenchConfig.threads, "torch threads (pinned for every contender).")
    repeats: int = option(DecodeBenchConfig.repeats, "Timed runs per contender (median).")
    new_tokens: int | None = option(
        None, "Tokens generated per concurrency-1 run (default: 64; glm_moe_dsa 16)."
    )
    int4: Path | None = option(
        None, "A compressed + calibrated SmolLM2 (default: built once with kvq compress + kvq calibrate)."
    )
    batch_seqs: int = option(
        DecodeBenchConfig.batch_seqs, "Requests decoded together in the concurrent comparison (BF16 vs INT4)."
    )
    batch_new_tokens: int = option(
        DecodeBenchConfig.batch_new_tokens, "Tokens generated per request in the concurrent comparison."
    )
    admission_slots: int = option(
        DecodeBenchConfig.admission_bf16_slots,
        "Requests a BF16 KV budget admits (FP8 pages of the same bytes: twice).",
    )
    admission_requests: int = option(
        DecodeBenchConfig.admission_requests, "Requests in the admission workload."
    )
    long_tokens: int = option(
        DecodeBenchConfig.long_tokens,
        "Length of the one long completion whose early vs late host ms per token are compared (each end: 256 "
        "tokens, or a quarter of it when shorter).",
    )
    model: str = option(
        "smollm2",
        "smollm2: the embedded SmolLM2 (every measure above); glm_moe_dsa: the MLA bench fixture, INT4 vs "
        "FP8-block weights and FP8 vs BF16 latent at concurrency 1 and 32 (kvq.bench.decode_mla).",
    )
    tp: int = option(
        1,
        "Above 1: the kvq contenders at --tp 1 and --tp N (torch.distributed ranks on this host), with each "
        "rank's weight and KV bytes (kvq.bench.decode_tp); the one-process sections are not run.",
    )
    bf16: Path | None = option(
        None, "The BF16 checkpoint (default: the embedded SmolLM2); pass --int4 with it."
    )
    vllm_python: Path | None = option(
        None,
        "The Python of a venv with vLLM's CPU build (make test-vllm: .venv-vllm/bin/python): adds vLLM on "
        "the BF16 weights as a contender at concurrency 1 and --batch-seqs (decode_vllm.py).",
    )


@field_options(DecodeOptions, "options")
@engine_options(
    "enforce_eager",
    "speculative",
    "num_speculative_tokens",
    help={
        "speculative": "mtp (with --model glm_moe_dsa): the bench fixture with an MTP layer decoded with and "
        "without speculation (random and fitted MTP head), tok/s, their ratio, acceptance rate, mean "
        "accepted length and target forwards per token (kvq.bench.decode_spec).",
    },
)
def bench_decode_command(*, options: GivenOptions, engine: GivenOptions, json_out: JsonOption = None) -> None:
    """Decode speed (INT4 vs BF16 weights vs transformers, at concurrency 1 and --batch-seqs), resident
    weight memory, FP8 vs BF16 KV capacity and admission throughput on the embedded SmolLM2-135M-Instruct;
    all ratios from one run. KVQ_CPU_ISA picks the CPU W4A16 path (printed with the results). With
    `--model glm_moe_dsa`: MLA decode on a GLM-5-shaped bench fixture (with `--speculative mtp`: with and
    without MTP speculative decoding)."""
    o = DecodeOptions(**options.values)
    model, tp = o.model, o.tp
    from kvq.data.embedded_model import ensure_smollm2

    speculative = engine.values["speculative"]
    if speculative is not None and (model != "glm_moe_dsa" or tp > 1):
        raise KvqError(
            f"--speculative {speculative} is for --model glm_moe_dsa at --tp 1 (SmolLM2 has no MTP layer); "
            "pass --model glm_moe_dsa, or drop --speculative"
        )
    if model == "glm_moe_dsa" and tp > 1:
        raise KvqError("--tp is for --model smollm2 (or --bf16/--int4); run the MLA bench at --tp 1")
    if speculative is not None:
        num_speculative_tokens = engine.values["num_speculative_tokens"]
        _bench_speculative(speculative, num_speculative_tokens, o, json_out)
        return
    if model == "glm_moe_dsa":
        from kvq.bench.decode_mla import MlaBenchConfig, render_mla, run_mla_bench

        mla_config = MlaBenchConfig(
            threads=o.threads, repeats=o.repeats, new_tokens=o.new_tokens or MlaBenchConfig.new_tokens
        )
        _report(run_mla_bench(mla_config), render_mla, json_out)
        return
    if model != "smollm2":
        raise KvqError(f"--model is {model!r}; pick smollm2 or glm_moe_dsa")
    config = DecodeBenchConfig(
        threads=o.threads,
        repeats=o.repeats,
        new_tokens=o.new_tokens or DecodeBenchConfig.new_tokens,
        batch_seqs=o.batch_seqs,
        batch_new_tokens=o.batch_new_tokens,
        admission_bf16_slots=o.admission_slots,
        admission_requests=o.admission_requests,
        long_tokens=o.long_tokens,
        long_window=min(DecodeBenchConfig.long_window, max(1, o.long_tokens // 4)),
        vllm_python=str(o.vllm_python) if o.vllm_python else None,
        enforce_eager=engine.values["enforce_eager"],
    )
    bf16, int4 = o.bf16, o.int4
    if bf16 is not None and int4 is None:
        raise KvqError("--bf16 is given without --int4; pass the INT4 checkpoint made from it too")
    bf16 = bf16 or ensure_smollm2().bf16
    int4 = int4 or ensure_smollm2_int4(bf16, config.group_size, config.calib_samples, config.calib_seq_len)
    if tp > 1:
        from kvq.bench.decode_tp import render_tp, run_tp_bench

        _report(run_tp_bench(config, bf16, int4, tp), render_tp, json_out)
        return
    _report(run_bench(config, bf16, int4), render, json_out)


def _bench_speculative(
    speculative: str, num_speculative_tokens: int, o: DecodeOptions, json_out: Path | None
) -> None:
    from kvq.bench.decode_spec import SpecBenchConfig, render_spec, run_spec_bench, spec_models
    from kvq.runtime.config import SPECULATIVE_METHODS

    if speculative not in SPECULATIVE_METHODS:
        raise KvqError(f"--speculative is {speculative!r}; pick one of {', '.join(SPECULATIVE_METHODS)}")
    if num_speculative_tokens < 1:
        raise KvqError(f"--num-speculative-tokens must be >= 1, got {num_speculative_tokens}")
    config = SpecBenchConfig(
        threads=o.threads,
        repeats=o.repeats,
        new_tokens=o.new_tokens or SpecBenchConfig.new_tokens,
        num_speculative_tokens=num_speculative_tokens,
    )
    _report(run_spec_bench(config, spec_models(config)), render_spec, json_out)


def _report(result: Any, render_result: Callable[[Any], Table], json_out: Path | None) -> None:
    """Print a bench's table and write its result dataclass as JSON where asked."""
    console.print(render_result(result))
    write_json(result, json_out)
