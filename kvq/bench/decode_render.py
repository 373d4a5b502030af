"""`kvq bench decode`'s report: a `DecodeBenchResult` (a run's, or one read back from its JSON) as one
table of speeds, the ratios between contenders, memory, KV capacity, admission and vLLM's numbers."""

from __future__ import annotations

import statistics

from rich.table import Table

from kvq.bench.decode import LM_HEAD_CONTENDERS, W4A8_CONTENDERS, DecodeBenchResult
from kvq.byte_sizes import format_bytes


def render(result: DecodeBenchResult) -> Table:
    table = Table(title=f"kvq bench decode (SmolLM2-135M-Instruct); {result.cpu_path}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for name, value in (*result.tok_s.items(), *result.tok_s_batch.items()):
        runs = result.tok_s_runs[name]
        label = name if name.startswith("c=") else f"c=1: {name}"
        table.add_row(label, f"{value:.1f} tok/s ({min(runs):.1f}-{max(runs):.1f})")
    tok, n = {**result.tok_s, **result.tok_s_batch}, result.config["batch_seqs"]
    bf16, int4, fp8 = "bf16 weights, bf16 kv", "int4 weights, bf16 kv", "int4 weights, fp8 kv"
    ratios = {
        "c=1: INT4 / BF16 weights (bf16 kv)": tok[f"kvq {int4}"] / tok[f"kvq {bf16}"],
        f"c={n}: INT4 / BF16 weights (bf16 kv)": tok[f"c={n}: kvq {int4}"] / tok[f"c={n}: kvq {bf16}"],
        "c=1: INT4 + FP8 kv / INT4 + BF16 kv": tok[f"kvq {fp8}"] / tok[f"kvq {int4}"],
        f"c={n}: INT4 + FP8 kv / INT4 + BF16 kv": tok[f"c={n}: kvq {fp8}"] / tok[f"c={n}: kvq {int4}"],
        **{
            f"c=1: INT4 + {mode} lm_head + FP8 kv / BF16 weights": tok[name] / tok[f"kvq {bf16}"]
            for mode, name in LM_HEAD_CONTENDERS.items()
        },
        f"c={n}: INT4 + int8 lm_head + FP8 kv / BF16 weights": tok[f"c={n}: {LM_HEAD_CONTENDERS['int8']}"]
        / tok[f"c={n}: kvq {bf16}"],
        "c=1: kvq INT4 + FP8 kv / transformers": tok[f"kvq {fp8}"] / tok["transformers generate, bf16"],
        **{
            f"{key}: {name.replace('int4 weights', 'INT4')} / BF16 weights": tok[f"{prefix}kvq {name}"]
            / tok[f"{prefix}kvq {bf16}"]
            for key, prefix in (("c=1", ""), (f"c={n}", f"c={n}: "))
            for name in W4A8_CONTENDERS
            if f"{prefix}kvq {name}" in tok
        },
    }
    for name, ratio in ratios.items():
        table.add_row(name, f"{ratio:.2f}x")
    host, window = result.host_ms, result.config["long_window"]
    table.add_row(
        f"host ms per token, first / last {window} of {result.config['long_tokens']}",
        f"{host['first']:.3f} / {host['last']:.3f} ms = {host['last'] / host['first']:.2f}x",
    )
    for name, m in result.memory.items():
        table.add_row(
            f"resident after load: {name}",
            f"{format_bytes(m['rss_delta'])} RSS, {format_bytes(m['weight_bytes'])} "
            f"weights, checkpoint {format_bytes(m['checkpoint_bytes'])}",
        )
    table.add_row(
        "pool tokens bf16 / fp8 (same bytes)",
        f"{result.pool_tokens['bf16']} / {result.pool_tokens['fp8_e4m3']} "
        f"= {result.pool_tokens['fp8_e4m3'] / result.pool_tokens['bf16']:.2f}x",
    )
    for name, a in result.admission.items():
        table.add_row(
            f"admission {name} kv ({format_bytes(a['kv_bytes'])})",
            f"peak running {a['peak_running']}, preemptions {a['preemptions']}, {a['tok_s']:.1f} tok/s, "
            f"RSS growth while serving {format_bytes(a['rss_growth'])}",
        )
    a = result.admission
    table.add_row("FP8 / BF16 total throughput", f"{a['fp8_e4m3']['tok_s'] / a['bf16']['tok_s']:.2f}x")
    if result.vllm:
        v = result.vllm
        table.add_row("vLLM", f"{v['vllm']}, BF16 weights, torch CPU capability {v['cpu_capability']}")
        for key, kvq_name in (("c=1", f"kvq {fp8}"), (f"c={n}", f"c={n}: kvq {fp8}")):
            median = statistics.median(v[key])
            table.add_row(
                f"{key}: vLLM bf16 weights", f"{median:.1f} tok/s ({min(v[key]):.1f}-{max(v[key]):.1f})"
            )
            table.add_row(f"{key}: kvq INT4 + FP8 kv / vLLM BF16", f"{tok[kvq_name] / median:.2f}x")
            for name in W4A8_CONTENDERS:
                if kvq_name.replace(fp8, name) in tok:
                    ratio = tok[kvq_name.replace(fp8, name)] / median
                    table.add_row(
                        f"{key}: kvq {name.replace('int4 weights', 'INT4')} / vLLM BF16", f"{ratio:.2f}x"
                    )
    return table
