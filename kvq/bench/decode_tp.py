"""`kvq bench decode --tp N`: the decode bench's kvq engines at --tp 1 and --tp N, with each rank's numbers.

Per contender (BF16 weights + BF16 KV, INT4 weights + BF16 KV, INT4 weights + FP8 KV) and per --tp: decode
tok/s at concurrency 1 and --batch-seqs (`decode_speed.decode_tok_s`: prefill cancels out, median over
the repeats), and per rank: the stored weight bytes it read (what `kvq plan --tp N` puts on each GPU),
the weight bytes it holds resident and their share of --tp 1's (about 1/N), its KV bytes per token and
the pages and tokens its pool holds (every rank's pool has rank 0's layout and page count: the fewest
any rank fits). The transformers contender, the RSS, pool-capacity and admission sections of the
one-process bench have no --tp form and are not run. Imports torch and kvq.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.table import Table

from kvq.bench.decode import DecodeBenchConfig, engine
from kvq.bench.decode_speed import decode_tok_s, kvq_generate
from kvq.byte_sizes import format_bytes

CONTENDERS = (  # (name, weights, kv cache dtype)
    ("kvq bf16 weights, bf16 kv", "bf16", "bf16"),
    ("kvq int4 weights, bf16 kv", "int4", "bf16"),
    ("kvq int4 weights, fp8 kv", "int4", "fp8_e4m3"),
)


@dataclass
class DecodeTpResult:
    config: dict
    tp: int
    cpu_path: str = ""
    runs: list[dict] = field(default_factory=list)  # one per contender and --tp (1, then N)


def measure(path: Path, kv_cache_dtype: str, tp: int, config: DecodeBenchConfig) -> dict:
    """One contender at `tp` ranks: tok/s at both concurrencies, and each rank's bytes."""
    from kvq.runtime.kv_pool import page_bytes

    n = config.batch_seqs
    e = engine(
        path, config, tp=tp, kv_cache_dtype=kv_cache_dtype, kv_memory=config.batch_kv_memory, max_num_seqs=n
    )
    single = decode_tok_s({"c=1": kvq_generate(e, 1)}, 1, config.new_tokens, config.repeats)["c=1"]
    batch = decode_tok_s({"c=n": kvq_generate(e, n)}, n, config.batch_new_tokens, config.repeats)["c=n"]
    pool = e.kv_pool
    kv_bytes_per_token = page_bytes(pool.layout, pool.num_layers, pool.page_size) // pool.page_size
    ranks = [
        {
            "rank": rank,
            "read_bytes": e.rank_read_bytes[rank],
            "resident_bytes": e.rank_weight_bytes[rank],
            "kv_bytes_per_token": kv_bytes_per_token,
            "kv_pages": pool.num_pages,
            "kv_tokens": pool.num_tokens,
        }
        for rank in range(tp)
    ]
    e.close()
    return {
        "tp": tp,
        "tok_s": statistics.median(single),
        "tok_s_batch": statistics.median(batch),
        "tok_s_runs": single,
        "tok_s_batch_runs": batch,
        "ranks": ranks,
    }


def run_tp_bench(config: DecodeBenchConfig, bf16: Path, int4: Path, tp: int) -> DecodeTpResult:
    from kvq.runtime.kernels import CpuOps, describe_cpu_path

    torch.set_num_threads(config.threads)
    result = DecodeTpResult(config=asdict(config), tp=tp, cpu_path=describe_cpu_path(CpuOps.choose()))
    paths = {"bf16": bf16, "int4": int4}
    for name, weights, kv in CONTENDERS:
        one, many = (measure(paths[weights], kv, n, config) for n in (1, tp))
        for rank in many["ranks"]:
            rank["resident_share_of_tp1"] = rank["resident_bytes"] / one["ranks"][0]["resident_bytes"]
        result.runs += [{"contender": name, **one}, {"contender": name, **many}]
    return result


def render_tp(result: DecodeTpResult) -> Table:
    """One row per rank of each run (tok/s on the run's first row: the ranks decode together)."""
    n = result.config["batch_seqs"]
    table = Table(title=f"kvq bench decode --tp {result.tp}; {result.cpu_path}")
    columns = ("contender", "--tp", "rank", "c=1 tok/s", f"c={n} tok/s", "read", "resident", "KV B/token")
    for column in (*columns, "KV tokens"):
        table.add_column(column, justify="left" if column == "contender" else "right")
    for run in result.runs:
        for r in run["ranks"]:
            first = r["rank"] == 0
            share = f" ({r['resident_share_of_tp1']:.3f} of tp 1)" if "resident_share_of_tp1" in r else ""
            table.add_row(
                run["contender"] if first else "",
                str(run["tp"]) if first else "",
                str(r["rank"]),
                f"{run['tok_s']:.1f}" if first else "",
                f"{run['tok_s_batch']:.1f}" if first else "",
                format_bytes(r["read_bytes"]),
                format_bytes(r["resident_bytes"]) + share,
                str(r["kv_bytes_per_token"]),
                str(r["kv_tokens"]),
            )
    return table
