"""The runtime engine's command-line options, shared by `kvq generate`, `serve`, `eval` and `bench decode`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvq.byte_sizes import SIZE_HELP
from kvq.kv_cache_dtypes import KV_CACHE_DTYPE_HELP, dtype_flag, kv_cache_dtype_flag

ModelArgument = Annotated[
    Path, typer.Argument(help="Checkpoint directory (BF16, FP8-block or compressed-tensors).")
]
OptionalModelArgument = Annotated[
    Path | None,
    typer.Argument(
        help="Checkpoint directory (BF16, FP8-block or compressed-tensors); default: --config's model."
    ),
]
# the options below that set an `EngineConfig` field of the same name (what a --config file may set too)
ENGINE_OPTION_NAMES = (
    "dtype", "kv_cache_dtype", "page_size", "kv_memory", "require_kv_scales", "threads", "kv_integrity",
    "max_num_seqs", "max_model_len", "lm_head_weights", "int4_compute", "tp", "enforce_eager",
)  # fmt: skip
MaxNumSeqsOption = Annotated[
    int, typer.Option(help="Most requests decoded together; the rest wait for KV pages.")
]
MaxModelLenOption = Annotated[
    int | None, typer.Option(help="Context length in tokens (default: the model's max_position_embeddings).")
]
KvCacheDtypeOption = Annotated[str, typer.Option(help=KV_CACHE_DTYPE_HELP, callback=kv_cache_dtype_flag)]
PageSizeOption = Annotated[int, typer.Option(help="Tokens per KV page.")]
KvMemoryOption = Annotated[
    str | None,
    typer.Option(help=f"KV pool size, e.g. 512MiB (default: a fraction of free memory). {SIZE_HELP}"),
]
RequireKvScalesOption = Annotated[
    bool,
    typer.Option("--require-kv-scales", help="Fail instead of warning when FP8 KV has no calibrated scales."),
]
DtypeOption = Annotated[
    str,
    typer.Option(
        help="Activations: auto (bfloat16), bfloat16 (or bf16) or float32 (or fp32: the reference mode, "
        "weights dequantized).",
        callback=dtype_flag,
    ),
]
ThreadsOption = Annotated[int | None, typer.Option(help="torch CPU threads.")]
KvIntegrityOption = Annotated[
    str,
    typer.Option(
        help="Checked KV pages: off (no checks, no cost); tags (before each step's attention, every "
        "page the request reads or writes must carry the tag its own tokens and allocations expect: "
        "catches freed, reused, misdirected and stale pages); full (tags, plus a hash of sampled "
        "bytes of every full page, taken when it was written: catches bytes changed in place). A "
        "failed check stops the request with an error naming the page."
    ),
]
LmHeadWeightsOption = Annotated[
    str,
    typer.Option(
        help="stored (the lm_head as the checkpoint has it; a tied embedding stays BF16), int8 (a W8A16 copy "
        "made at load, a scale per row) or int4 (W4A16, group 32): faster decode on CPU for some quality "
        "cost (int4 more than int8): measure it with kvq eval."
    ),
]
Int4ComputeOption = Annotated[
    str,
    typer.Option(
        help="How INT4 Linears multiply on CPU: w4a16 (the 16-bit activations, exact) or w4a8 (activations "
        "quantized to int8 per row and 64 inputs, exact integer sums on AVX-512 VNNI: faster batches and "
        "decode for some quality; measure it with kvq eval). Stacked MoE experts too; an INT8 lm_head copy "
        "runs as w8a8."
    ),
]
EnforceEagerOption = Annotated[
    bool,
    typer.Option(
        "--enforce-eager",
        help="Run every decode step through the layers' Python (as vLLM's --enforce-eager keeps CUDA "
        "graphs off). Default: CPU decode of Llama and GLM-4.5 models replays one list of C calls bound "
        "once per batch size, the same values without the per-op Python.",
    ),
]
TpOption = Annotated[
    int,
    typer.Option(
        "--tp",
        help="Tensor-parallel ranks, one device each (gloo on CPU, NCCL on CUDA). kvq starts the other "
        "ranks itself, or runs under torchrun (then WORLD_SIZE must equal --tp). Heads, MLP/expert "
        "intermediate size and vocabulary must split evenly (INT4 on group, FP8 on block boundaries).",
    ),
]
