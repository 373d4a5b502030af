"""Kernel benchmark behind scripts/gpu_check.sh; every timed call is also checked against its reference.

`python -m kvq.bench.kernels --out DIR/kernel_bench.json` (CUDA): device copy bandwidth
(bytes = 2 x size, read + write), W4A16 GEMV vs BF16 matmul at GLM-5 expert shapes (bytes = packed
N*K/2 + scales N*K/G*2 + activations M*K*2 + M*N*2), the fused MoE, and FP8 vs BF16 paged decode
attention at 1K/8K/32K context. Exit 1 on any mismatch or error, 3 on a missed H100/H200 target.
`--cpu --threads 2`: copy bandwidth and the CPU W4A16 path (KVQ_CPU_ISA) vs a BF16 matmul only; with
`--smollm2`, at the Linears of `kvq bench decode`'s model (SmolLM2-135M, group 64) and 1-64 rows. Nothing
runs at import.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch

from kvq.formats.fp8_e4m3 import FP8_E4M3_MAX
from kvq.formats.pack_quantized import dequantize_pack_quantized
from kvq.runtime.kernels import (
    DecodeTables,
    PagedKVCache,
    fused_moe_reference,
    fused_moe_w4a16,
    paged_decode_attention_reference,
    prepare_w4a16,
    w4a16_linear,
)

EXIT_MISMATCH, EXIT_TARGET_MISSED = 1, 3


@dataclass(frozen=True)
class BenchConfig:
    """Shapes (GLM-5: hidden 6144, expert intermediate 2048, 256 experts top-8) and the issue's targets."""

    gemv_shapes: tuple[tuple[str, int, int], ...] = (
        ("expert_gate_up", 4096, 6144),  # one expert's gate+up: N = 2 * 2048, K = 6144
        ("expert_down", 6144, 2048),
        ("top8_gate_up", 8 * 4096, 6144),  # the 8 routed experts a decode step reads, as one matrix
        ("top8_down", 8 * 6144, 2048),
    )
    target_shapes: tuple[str, ...] = ("top8_gate_up", "top8_down")
    batches: tuple[int, ...] = (1, 8, 32)
    group_size: int = 128
    num_experts: int = 256
    hidden: int = 6144
    intermediate: int = 2048
    top_k: int = 8
    attn_batch: int = 16
    attn_q_heads: int = 64
    attn_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    contexts: tuple[int, ...] = (1024, 8192, 32768)
    copy_bytes: int = 1 << 30
    cpu_repeats: int = 15  # timed calls per CPU measurement (CUDA: do_bench decides)
    sweep_block_n: tuple[int, ...] = (64, 128, 256)  # GEMV tiles tried at batch 1 on the target shapes
    sweep_split_k: tuple[int, ...] = (1, 2)
    sweep_nibble_planes: tuple[bool, ...] = (True, False)
    target_gemv_fraction: float = 0.60
    target_gemv_speedup: float = 2.5
    target_attention_speedup: float = 1.6


def smollm2_config(cfg: BenchConfig) -> BenchConfig:
    """cfg at SmolLM2-135M's Linears (hidden 576, intermediate 1536, 9 + 2 x 3 heads of 64; group 64) and
    the batch sizes the CPU paths switch at (1: the GEMV; 4: AMX, from AMX_FROM_ROWS = 3; 32: one AMX
    pass)."""
    shapes = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536))
    return replace(cfg, gemv_shapes=shapes, target_shapes=(), group_size=64, batches=(1, 4, 16, 32, 64))


def time_ms(fn: Callable[[], object], device: torch.device, cpu_repeats: int = 15) -> float:
    """Median milliseconds of `fn` (CUDA: triton's do_bench, L2 flushed per run; CPU: perf_counter)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=60, return_mode="median"))
    for _ in range(3):  # warm-up: first calls pack weights / fault pages in
        fn()
    times = []
    for _ in range(cpu_repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def check(
    name: str, actual: torch.Tensor, expected: torch.Tensor, rel: float, mismatches: list[str]
) -> float:
    """Relative max error of `actual`; appends to `mismatches` when above `rel` or not finite."""
    err = (
        (actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-6)
    ).item()
    if not err <= rel:
        mismatches.append(f"{name}: relative max error {err:.3g} > {rel}")
    return err


def random_w4a16(num_experts: int | None, rows: int, cols: int, group_size: int, device: torch.device):
    """Random packed words (q uniform in -8..7) and bf16 scales ~ 1e-3, optionally stacked."""
    lead = () if num_experts is None else (num_experts,)
    packed = torch.randint(-(2**31), 2**31 - 1, (*lead, rows, cols // 8), dtype=torch.int32, device=device)
    scale = (torch.rand(*lead, rows, cols // group_size, device=device) * 2e-3 + 5e-4).to(torch.bfloat16)
    return packed, scale


def bench_copy(cfg: BenchConfig, device: torch.device) -> float:
    """Device copy bandwidth in GB/s, counting read + write."""
    src = torch.empty(cfg.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, cfg.cpu_repeats)
    return 2 * cfg.copy_bytes / ms / 1e6


def bench_gemv(
    cfg: BenchConfig, device: torch.device, copy_gbps: float | None, mismatches: list[str]
) -> list[dict]:
    rows = []
    gen_x = torch.randn(max(cfg.batches), max(k for _, _, k in cfg.gemv_shapes), device=device)
    for name, n, k in cfg.gemv_shapes:
        packed, scale = random_w4a16(None, n, k, cfg.group_size, device)
        w = prepare_w4a16(packed, scale, cfg.group_size)
        dense = dequantize_pack_quantized(packed, scale, dtype=torch.float32)  # [N, K] fp32, the reference
        dense_bf16 = dense.to(torch.bfloat16)
        for m in cfg.batches:
            x = gen_x[:m, :k].to(torch.bfloat16)
            err = check(f"w4a16 {name} M={m}", w4a16_linear(x, w), x.float() @ dense.T, 2e-2, mismatches)
            ms = time_ms(partial(w4a16_linear, x, w), device, cfg.cpu_repeats)
            bf16_ms = time_ms(partial(torch.matmul, x, dense_bf16.T), device, cfg.cpu_repeats)
            num_bytes = n * k // 2 + n * (k // cfg.group_size) * 2 + m * k * 2 + m * n * 2
            gbps = num_bytes / ms / 1e6
            rows.append(
                dict(
                    shape=name,
                    N=n,
                    K=k,
                    batch=m,
                    group_size=cfg.group_size,
                    backend=w.backend,
                    time_us=ms * 1e3,
                    gbps=gbps,
                    fraction_of_copy=gbps / copy_gbps if copy_gbps else None,
                    bf16_time_us=bf16_ms * 1e3,
                    speedup_vs_bf16=bf16_ms / ms,
                    max_rel_err=err,
                )
            )
        del packed, scale, w, dense, dense_bf16
    return rows


def bench_gemv_sweep(
    cfg: BenchConfig, device: torch.device, copy_gbps: float | None, mismatches: list[str]
) -> list[dict]:
    """Batch-1 GEMV on the target shapes over a few tile configs (to tune `choose_config` from)."""
    from kvq.runtime.kernels.triton.w4a16 import W4A16LaunchConfig, choose_config, w4a16_linear_triton

    rows = []
    for name, n, k in (shape for shape in cfg.gemv_shapes if shape[0] in cfg.target_shapes):
        packed, scale = random_w4a16(None, n, k, cfg.group_size, device)
        w = prepare_w4a16(packed, scale, cfg.group_size, backend="triton")
        x = torch.randn(1, k, device=device).to(torch.bfloat16)
        expected = w4a16_linear(x, w).float()
        default = choose_config(1, n, k, cfg.group_size, device)
        block_k = min(cfg.group_size, 128)
        grid = itertools.product(cfg.sweep_block_n, cfg.sweep_split_k, cfg.sweep_nibble_planes)
        for block_n, split_k, is_planes in grid:
            if is_planes and block_k != 128:
                continue
            warps = 8 if block_n >= 256 else 4
            config = W4A16LaunchConfig(16, block_n, block_k, split_k, warps, 4, nibble_planes=is_planes)
            check(f"sweep {name} {config}", w4a16_linear_triton(x, w, config), expected, 2e-2, mismatches)
            ms = time_ms(partial(w4a16_linear_triton, x, w, config), device, cfg.cpu_repeats)
            gbps = (n * k // 2 + n * (k // cfg.group_size) * 2 + k * 2 + n * 2) / ms / 1e6
            rows.append(
                dict(
                    shape=name,
                    block_n=block_n,
                    split_k=split_k,
                    nibble_planes=is_planes,
                    num_warps=warps,
                    is_default=config == default,
                    time_us=ms * 1e3,
                    gbps=gbps,
                    fraction_of_copy=gbps / copy_gbps if copy_gbps else None,
                )
            )
    return rows


def bench_moe(cfg: BenchConfig, device: torch.device, mismatches: list[str]) -> list[dict]:
    e, h, inter, top_k, g = cfg.num_experts, cfg.hidden, cfg.intermediate, cfg.top_k, cfg.group_size
    w13_packed, w13_scale = random_w4a16(e, 2 * inter, h, g, device)
    w2_packed, w2_scale = random_w4a16(e, h, inter, g, device)
    w13, w2 = prepare_w4a16(w13_packed, w13_scale, g), prepare_w4a16(w2_packed, w2_scale, g)
    expert_bytes = 2 * inter * h // 2 + 2 * inter * (h // g) * 2 + h * inter // 2 + h * (inter // g) * 2
    rows = []
    for t in cfg.batches:
        x = torch.randn(t, h, device=device).to(torch.bfloat16)
        topk_ids = torch.rand(t, e, device=device).argsort(dim=1)[:, :top_k]
        topk_weights = torch.rand(t, top_k, device=device)
        y = fused_moe_w4a16(x, topk_ids, topk_weights, w13, w2)
        expected = fused_moe_reference(
            x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, g
        )
        err = check(f"fused_moe T={t}", y, expected, 3e-2, mismatches)
        moe = partial(fused_moe_w4a16, x, topk_ids, topk_weights, w13, w2)
        ms = time_ms(moe, device, cfg.cpu_repeats)
        num_active = int(topk_ids.unique().numel())
        gbps = num_active * expert_bytes / ms / 1e6
        rows.append(
            dict(tokens=t, active_experts=num_active, time_us=ms * 1e3, weight_gbps=gbps, max_rel_err=err)
        )
    return rows


def _paged(cfg: BenchConfig, context: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    num_pages = cfg.attn_batch * context // cfg.page_size
    shape = (num_pages, cfg.page_size, cfg.attn_kv_heads, cfg.head_dim)
    k_cache = torch.randn(shape, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device=device, dtype=torch.bfloat16)
    block_tables = torch.randperm(num_pages, device=device).view(cfg.attn_batch, -1).to(torch.int32)
    seq_lens = torch.full((cfg.attn_batch,), context, dtype=torch.int32, device=device)
    return k_cache, v_cache, block_tables, seq_lens


def bench_attention(cfg: BenchConfig, device: torch.device, mismatches: list[str]) -> list[dict]:
    rows = []
    for context in cfg.contexts:
        k_bf16, v_bf16, block_tables, seq_lens = _paged(cfg, context, device)
        k_scale = k_bf16.abs().amax(dim=(0, 1, 3)).float() / FP8_E4M3_MAX  # [Hkv] per-head scales
        v_scale = v_bf16.abs().amax(dim=(0, 1, 3)).float() / FP8_E4M3_MAX
        k_fp8 = (k_bf16 / k_scale[:, None].to(torch.bfloat16)).to(torch.float8_e4m3fn)
        v_fp8 = (v_bf16 / v_scale[:, None].to(torch.bfloat16)).to(torch.float8_e4m3fn)
        q = torch.randn(cfg.attn_batch, cfg.attn_q_heads, cfg.head_dim, device=device).to(torch.bfloat16)
        row: dict = dict(
            context=context, batch=cfg.attn_batch, q_heads=cfg.attn_q_heads, kv_heads=cfg.attn_kv_heads
        )
        for label, k_cache, v_cache in (("bf16", k_bf16, v_bf16), ("fp8", k_fp8, v_fp8)):
            cache = PagedKVCache.of(k_cache, v_cache, k_scale, v_scale)
            tables = DecodeTables(block_tables, seq_lens, max_seq_len=context)
            y = cache.decode_attention(q, tables)
            expected = paged_decode_attention_reference(
                q[:2], cache, DecodeTables(block_tables[:2], seq_lens[:2])
            )
            row[f"{label}_max_rel_err"] = check(
                f"attention {label} ctx={context}", y[:2], expected, 2e-2, mismatches
            )
            attention = partial(cache.decode_attention, q, tables)
            ms = time_ms(attention, device, cfg.cpu_repeats)
            row[f"{label}_time_us"] = ms * 1e3
            row[f"{label}_gbps"] = 2 * k_cache.numel() * k_cache.element_size() / ms / 1e6
        row["fp8_speedup"] = row["bf16_time_us"] / row["fp8_time_us"]
        rows.append(row)
        del k_bf16, v_bf16, k_fp8, v_fp8
    return rows


def evaluate_targets(cfg: BenchConfig, result: dict) -> list[dict]:
    """The issue's H100/H200 targets, each with its measured value."""
    targets = []
    for row in result.get("w4a16_gemv", []):
        if row["batch"] == 1 and row["shape"] in cfg.target_shapes:
            if row["fraction_of_copy"] is not None:
                targets.append(
                    dict(
                        name=f"gemv {row['shape']} M=1 fraction of copy bandwidth",
                        value=row["fraction_of_copy"],
                        threshold=cfg.target_gemv_fraction,
                    )
                )
            targets.append(
                dict(
                    name=f"gemv {row['shape']} M=1 speedup vs bf16 matmul",
                    value=row["speedup_vs_bf16"],
                    threshold=cfg.target_gemv_speedup,
                )
            )
    for row in result.get("decode_attention", []):
        if row["context"] == max(cfg.contexts):
            targets.append(
                dict(
                    name=f"fp8 vs bf16 decode attention at {row['context']} tokens",
                    value=row["fp8_speedup"],
                    threshold=cfg.target_attention_speedup,
                )
            )
    for target in targets:
        target["passed"] = target["value"] >= target["threshold"]
    return targets


def print_tables(result: dict) -> None:
    print(f"device: {result['device']}  copy bandwidth: {result.get('copy_gbps') or 0:.0f} GB/s")
    for title, rows in (
        ("W4A16 GEMV", result.get("w4a16_gemv", [])),
        ("W4A16 GEMV tile sweep (batch 1)", result.get("gemv_sweep", [])),
        ("fused MoE", result.get("fused_moe", [])),
        ("decode attention", result.get("decode_attention", [])),
        ("targets", result["targets"]),
    ):
        if not rows:
            continue
        print(f"\n{title}")
        keys = list(rows[0])
        print("  ".join(f"{key:>14}" for key in keys))
        for row in rows:
            print("  ".join(f"{v:>14.3g}" if isinstance(v, float) else f"{v!s:>14}" for v in row.values()))
    for line in result["mismatches"] + result["errors"]:
        print(f"MISMATCH/ERROR: {line}")


def cpu_device() -> str:
    """The device name for CPU runs: cpu, the W4A16 path and the CPU's features (`describe_cpu_path`)."""
    from kvq.runtime.kernels.cpu.ops import CpuOps
    from kvq.runtime.kernels.cpu.path import describe_cpu_path

    return f"cpu; {describe_cpu_path(CpuOps.choose())}"


def run(cfg: BenchConfig, device: torch.device) -> dict:
    """Every section (each one guarded: an error is recorded and the others still run)."""
    result: dict = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_device(),
        torch=torch.__version__,
        config=asdict(cfg),
        mismatches=[],
        errors=[],
    )
    mismatches = result["mismatches"]
    sections: list[tuple[str, Callable[[], object]]] = [("copy_gbps", lambda: bench_copy(cfg, device))]
    if cfg.gemv_shapes:
        sections.append(("w4a16_gemv", lambda: bench_gemv(cfg, device, result.get("copy_gbps"), mismatches)))
    if cfg.sweep_block_n and any(shape[0] in cfg.target_shapes for shape in cfg.gemv_shapes):
        sections.append(
            ("gemv_sweep", lambda: bench_gemv_sweep(cfg, device, result.get("copy_gbps"), mismatches))
        )
    if cfg.num_experts:
        sections.append(("fused_moe", lambda: bench_moe(cfg, device, mismatches)))
    if cfg.contexts:
        sections.append(("decode_attention", lambda: bench_attention(cfg, device, mismatches)))
    for name, section in sections:
        try:
            result[name] = section()
        except Exception:  # record it and keep the other sections' numbers
            result["errors"].append(f"{name}: {traceback.format_exc(limit=4)}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["targets"] = evaluate_targets(cfg, result)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    parser.add_argument("--cpu", action="store_true", help="CPU W4A16 path vs bf16 matmul only")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (pin for CPU numbers)")
    parser.add_argument("--smollm2", action="store_true", help="--cpu at SmolLM2-135M's Linears, 1-64 rows")
    parser.add_argument("--no-enforce-targets", action="store_true", help="report H100/H200 targets only")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine, or pass --cpu")
    device = torch.device("cpu" if args.cpu else "cuda")
    cfg = BenchConfig()
    if args.cpu:  # the two single-expert shapes; MoE and attention at these sizes are GPU work
        cfg = BenchConfig(gemv_shapes=cfg.gemv_shapes[:2], num_experts=0, contexts=(), copy_bytes=1 << 28)
        cfg = smollm2_config(cfg) if args.smollm2 else cfg
    elif args.smollm2:
        parser.error("--smollm2 is a CPU bench: pass --cpu")
    result = run(cfg, device)
    print_tables(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    if result["mismatches"] or result["errors"]:
        return EXIT_MISMATCH
    is_target_device = any(name in result["device"] for name in ("H100", "H200"))
    if is_target_device and not args.no_enforce_targets and not all(t["passed"] for t in result["targets"]):
        return EXIT_TARGET_MISSED
    return 0


if __name__ == "__main__":
    sys.exit(main())
