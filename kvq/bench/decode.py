"""`kvq bench decode`: the runtime's decode speed, weight memory and KV capacity on SmolLM2, in one run.

1. Concurrency 1: kvq with BF16 weights, kvq with INT4 weights (kvq compress, W4A16 group 64; BF16 and
   FP8 KV; and with the opt-in INT8 and INT4 lm_head copies), and transformers `generate` (BF16) on the
   same chat prompt; decode tok/s = (N - 1) / (t(N) - t(1)), median (and range) over the repeats.
   Concurrency 32: the same prompt 32 times, decoded together, BF16 vs INT4 weights (and INT8 lm_head).
   Both also run INT4 as W4A8 (`int4_compute="w4a8"`, opt-in; alone and with the INT8 lm_head) where a
   W4A8 kernel runs (AVX2 and up).
   The CPU's ISA and the W4A16 path that ran (KVQ_CPU_ISA) are printed with the results.
1b. Host time per token over one long completion (INT4, 2,048 tokens): each step's wall time minus its
   model forward (`Engine.stats`), early tokens vs late ones: flat when no per-token host cost grows.
2. Resident weights after load (fresh subprocesses, RSS delta) vs the checkpoint's tensor bytes, and
   transformers' load of the same compressed checkpoint (it decompresses to dense BF16).
3. KV pool: tokens held by BF16 and FP8 pools of the same bytes.
4. Admission: a KV budget where BF16 pages admit 32 requests; FP8 pages of the same bytes admit 64; the
   same 64-request workload through both (INT4 weights), total generated tokens / wall time.
The INT4 model is built once (kvq compress + kvq calibrate, `kvq.smollm2_int4`).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from kvq.bench.decode_speed import PROMPT, decode_tok_s, kvq_generate, transformers_generate


@dataclass(frozen=True)
class DecodeBenchConfig:
    """Every setting of the benchmark (the CLI flags default to these)."""

    threads: int = 2
    repeats: int = 5
    new_tokens: int = 64  # concurrency-1 runs
    batch_seqs: int = 32  # the concurrent-decode comparison
    batch_new_tokens: int = 32
    batch_kv_memory: int = 128 * 1024**2  # BF16 pages for batch_seqs full requests
    long_tokens: int = 2048  # host time per token over one completion this long
    long_window: int = 256  # tokens at each end of it compared
    group_size: int = 64  # SmolLM2's hidden size 576 is not a multiple of 128
    calib_samples: int = 32
    calib_seq_len: int = 512
    pool_bytes: int = 64 * 1024**2  # capacity comparison
    admission_requests: int = 64
    admission_bf16_slots: int = 32  # the BF16 budget holds this many full requests
    admission_prompt_tokens: int = 32
    admission_max_tokens: int = 64
    page_size: int = 16
    vllm_python: str | None = None  # vLLM's venv interpreter: its CPU build as a BF16 contender
    enforce_eager: bool = False  # kvq's engines without decode plans (`EngineConfig.enforce_eager`)


@dataclass
class DecodeBenchResult:
    config: dict
    cpu_path: str = ""  # the CPU's ISA and the W4A16 path that ran
    tok_s: dict[str, float] = field(default_factory=dict)  # concurrency 1, median
    tok_s_batch: dict[str, float] = field(default_factory=dict)  # concurrency batch_seqs, median
    tok_s_runs: dict[str, list[float]] = field(default_factory=dict)  # every repeat, both concurrencies
    host_ms: dict[str, float] = field(default_factory=dict)  # per token, early vs late in a long completion
    memory: dict[str, dict] = field(default_factory=dict)
    pool_tokens: dict[str, int] = field(default_factory=dict)
    admission: dict[str, dict] = field(default_factory=dict)
    vllm: dict = field(default_factory=dict)  # `decode_vllm.vllm_decode`'s report, when asked for


# the BF16 contender runs its (tied) lm_head as stored, as the checkpoint is served elsewhere; the INT4 ones
# take kvq's default ("auto": an INT8 copy of a tied lm_head on CPU) unless named here
LM_HEAD_CONTENDERS = {mode: f"kvq int4 weights + {mode} lm_head, fp8 kv" for mode in ("int8", "int4")}
W4A8_CONTENDERS = {  # the opt-in int4_compute="w4a8", where the CPU runs it: alone, and with the int8 lm_head
    "int4 weights as w4a8, fp8 kv": {"int4_compute": "w4a8"},
    "int4 weights as w4a8 + int8 lm_head, fp8 kv": {"int4_compute": "w4a8", "lm_head_weights": "int8"},
}
_LOAD_SNIPPET = """
import ctypes, gc, json, sys, psutil, torch
torch.set_num_threads(1)
kind, path = sys.argv[1], sys.argv[2]
process, libc = psutil.Process(), ctypes.CDLL("libc.so.6")

def rss():  # what stays resident: freed heap handed back first
    gc.collect()
    libc.malloc_trim(0)
    return process.memory_info().rss

if kind == "kvq":
    import kvq.runtime.engine  # imports first, so the delta is the load
    from kvq.runtime.config import EngineConfig
    before = rss()
    engine = kvq.runtime.engine.Engine(EngineConfig(model=path, kv_memory=1 << 20))
    weight_bytes, ckpt_bytes = engine.weight_bytes, engine.ckpt.tensor_bytes
else:
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig
    from kvq.checkpoint.reader import Checkpoint
    before = rss()
    tokenizer = AutoTokenizer.from_pretrained(path)  # the engine holds one too
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(dequantize=True))
    unique = {t.data_ptr(): t for t in model.state_dict().values()}
    weight_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    ckpt_bytes = Checkpoint.open(path).tensor_bytes
print(json.dumps({"rss_delta": rss() - before, "weight_bytes": weight_bytes, "checkpoint_bytes": ckpt_bytes}))
"""


def engine(path: Path, config: DecodeBenchConfig, **kwargs):
    from kvq.runtime.config import EngineConfig
    from kvq.runtime.engine import Engine

    settings: dict[str, Any] = {"threads": config.threads, "page_size": config.page_size}
    return Engine(EngineConfig(model=str(path), enforce_eager=config.enforce_eager, **settings, **kwargs))


def resident_after_load(kind: str, path: Path) -> dict:
    """RSS delta of loading `path` in a fresh process ("kvq" engine or "transformers"), with byte counts."""
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_SNIPPET, kind, str(path)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def admission_run(path: Path, config: DecodeBenchConfig, kv_cache_dtype: str, kv_memory: int) -> dict:
    """The admission workload on a pool of `kv_memory` bytes: throughput, peak running, preemptions."""
    from kvq.runtime.sampling import SamplingParams

    e = engine(path, config, kv_cache_dtype=kv_cache_dtype, kv_memory=kv_memory, max_num_seqs=256)
    tokens = e.encode(
        " ".join(f"Paris is the capital of France and item {i} of a long list." for i in range(200))
    )
    n = config.admission_prompt_tokens
    prompts = [tokens[7 * i : 7 * i + n] for i in range(config.admission_requests)]  # distinct windows
    params = SamplingParams(max_tokens=config.admission_max_tokens, ignore_eos=True)
    e.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    for prompt in prompts:
        e.add_request(prompt, params)
    process = psutil.Process()
    rss_start = process.memory_info().rss  # every request queued, none admitted yet
    peak_running, peak_rss, generated, start = 0, rss_start, 0, time.perf_counter()
    while e.has_unfinished_requests():
        outputs = e.step()
        peak_running = max(peak_running, len(e.scheduler.running) + sum(o.finished for o in outputs))
        peak_rss = max(peak_rss, process.memory_info().rss)
        generated += sum(len(o.token_ids) for o in outputs if o.finished)
    wall = time.perf_counter() - start
    return {
        "kv_pages": e.kv_pool.num_pages,
        "kv_tokens": e.kv_pool.num_tokens,
        "peak_running": peak_running,
        "preemptions": e.scheduler.num_preemptions,
        "rss_growth": peak_rss - rss_start,
        "wall_s": wall,
        "tok_s": generated / wall,
    }


def host_ms_per_token(path: Path, config: DecodeBenchConfig) -> dict[str, float]:
    """Median host ms per decode step (step wall time minus model forward) over the first and the last
    `long_window` tokens of one `long_tokens`-token completion."""
    from kvq.bench.decode_speed import PROMPT
    from kvq.runtime.sampling import SamplingParams

    e = engine(path, config, kv_memory="256MiB", max_num_seqs=1)
    e.add_request(e.encode_chat(PROMPT), SamplingParams(max_tokens=config.long_tokens, ignore_eos=True))
    host: list[float] = []
    while e.has_unfinished_requests():
        step, forward = e.stats.step_seconds, e.stats.forward_seconds
        e.step()
        host.append((e.stats.step_seconds - step) - (e.stats.forward_seconds - forward))
    decode = host[1:]  # the first step is the prefill
    first, last = decode[: config.long_window], decode[-config.long_window :]
    return {"first": 1e3 * statistics.median(first), "last": 1e3 * statistics.median(last)}


def run_bench(config: DecodeBenchConfig, bf16: Path, int4: Path) -> DecodeBenchResult:
    from kvq.runtime.kernels import CpuOps, describe_cpu_path
    from kvq.runtime.kernels.cpu.w4a8 import w4a8_path
    from kvq.runtime.kv_layout import layout_for
    from kvq.runtime.kv_pool import page_bytes

    torch.set_num_threads(config.threads)
    ops = CpuOps.choose()  # what the engines below choose ($KVQ_CPU_ISA, else auto)
    w4a8 = w4a8_path(ops.isa) is not None
    cpu_path = describe_cpu_path(ops, "w4a8" if w4a8 else "w4a16")  # W4A8 contenders: theirs too
    result = DecodeBenchResult(config=asdict(config), cpu_path=cpu_path)

    def one(path: Path, kv: str, **kwargs) -> object:
        return engine(path, config, kv_cache_dtype=kv, kv_memory="64MiB", max_num_seqs=1, **kwargs)

    contenders = {
        "kvq bf16 weights, bf16 kv": kvq_generate(one(bf16, "bf16", lm_head_weights="stored"), 1),
        "kvq int4 weights, bf16 kv": kvq_generate(one(int4, "bf16"), 1),
        "kvq int4 weights, fp8 kv": kvq_generate(one(int4, "fp8_e4m3"), 1),
        **{
            name: kvq_generate(one(int4, "fp8_e4m3", lm_head_weights=mode), 1)
            for mode, name in LM_HEAD_CONTENDERS.items()
        },
        **{
            f"kvq {name}": kvq_generate(one(int4, "fp8_e4m3", **settings), 1)
            for name, settings in W4A8_CONTENDERS.items()
            if w4a8
        },
        "transformers generate, bf16": transformers_generate(bf16),
    }
    runs = decode_tok_s(contenders, 1, config.new_tokens, config.repeats)
    del contenders
    n = config.batch_seqs

    def batch(path: Path, kv: str, **kwargs) -> object:
        return engine(
            path, config, kv_cache_dtype=kv, kv_memory=config.batch_kv_memory, max_num_seqs=n, **kwargs
        )

    contenders = {
        f"c={n}: kvq bf16 weights, bf16 kv": kvq_generate(batch(bf16, "bf16", lm_head_weights="stored"), n),
        f"c={n}: kvq int4 weights, bf16 kv": kvq_generate(batch(int4, "bf16"), n),
        f"c={n}: kvq int4 weights, fp8 kv": kvq_generate(batch(int4, "fp8_e4m3"), n),
        f"c={n}: {LM_HEAD_CONTENDERS['int8']}": kvq_generate(
            batch(int4, "fp8_e4m3", lm_head_weights="int8"), n
        ),
        **{
            f"c={n}: kvq {name}": kvq_generate(batch(int4, "fp8_e4m3", **settings), n)
            for name, settings in W4A8_CONTENDERS.items()
            if w4a8
        },
    }
    batch_runs = decode_tok_s(contenders, n, config.batch_new_tokens, config.repeats)
    del contenders
    result.tok_s_runs = {**runs, **batch_runs}
    result.tok_s = {name: statistics.median(r) for name, r in runs.items()}
    result.tok_s_batch = {name: statistics.median(r) for name, r in batch_runs.items()}
    result.host_ms = host_ms_per_token(int4, config)
    result.memory["kvq bf16"] = resident_after_load("kvq", bf16)
    result.memory["kvq int4"] = resident_after_load("kvq", int4)
    result.memory["transformers int4 (decompressed)"] = resident_after_load("transformers", int4)
    e = engine(int4, config, kv_memory=1 << 20)
    layers = e.kv_pool.num_layers
    for name, dtype in (("bf16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn)):
        result.pool_tokens[name] = (
            config.pool_bytes
            // page_bytes(layout_for(e.kv_spec, dtype), layers, config.page_size)
            * config.page_size
        )
    pages_per_request = -(-(config.admission_prompt_tokens + config.admission_max_tokens) // config.page_size)
    budget = (
        config.admission_bf16_slots
        * pages_per_request
        * page_bytes(layout_for(e.kv_spec, torch.bfloat16), layers, config.page_size)
    )
    for name in ("bf16", "fp8_e4m3"):
        result.admission[name] = {"kv_bytes": budget, **admission_run(int4, config, name, budget)}
    if config.vllm_python:
        from kvq.bench.decode_vllm import vllm_decode

        result.vllm = vllm_decode(
            Path(config.vllm_python),
            bf16,
            e.encode_chat(PROMPT),
            threads=config.threads,
            repeats=config.repeats,
            new_tokens=config.new_tokens,
            batch_seqs=n,
            batch_new_tokens=config.batch_new_tokens,
        )
    return result
