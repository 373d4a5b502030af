"""`kvq bench decode`'s report (`kvq.bench.decode_render.render`) from the JSON of a recorded run
(`benchmarks/`, the Zen 4 run BENCHMARKS.md cites): the speeds as recorded, and each ratio row the quotient
of the medians it names, recomputed here."""

from __future__ import annotations

import io
import json
import statistics
from pathlib import Path

from rich.console import Console

from kvq.bench.decode import DecodeBenchResult
from kvq.bench.decode_render import render

RUN = Path(__file__).parents[1] / "benchmarks" / "decode-avx512bf16-w8a8-zen4-s40.json"


def _rows(result: DecodeBenchResult) -> dict[str, str]:
    console = Console(width=240, record=True, file=io.StringIO())
    console.print(render(result))
    rows = {}
    for line in console.export_text().splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) == 4 and cells[1]:
            rows[cells[1]] = cells[2]
    return rows


def test_report_of_a_recorded_run() -> None:
    data = json.loads(RUN.read_text())
    result = DecodeBenchResult(**data)
    rows = _rows(result)
    tok = {**result.tok_s, **result.tok_s_batch}
    head = "kvq int4 weights as w4a8 + int8 lm_head, fp8 kv"
    assert rows[f"c=1: {head}"] == "165.1 tok/s (141.8-172.8)"
    expected = {
        "c=1: INT4 / BF16 weights (bf16 kv)": tok["kvq int4 weights, bf16 kv"]
        / tok["kvq bf16 weights, bf16 kv"],
        "c=1: INT4 as w4a8 + int8 lm_head, fp8 kv / BF16 weights": tok[head]
        / tok["kvq bf16 weights, bf16 kv"],
        "c=32: INT4 as w4a8 + int8 lm_head, fp8 kv / BF16 weights": tok[f"c=32: {head}"]
        / tok["c=32: kvq bf16 weights, bf16 kv"],
        "c=32: kvq INT4 as w4a8 + int8 lm_head, fp8 kv / vLLM BF16": tok[f"c=32: {head}"]
        / statistics.median(data["vllm"]["c=32"]),
    }
    for name, ratio in expected.items():
        assert rows[name] == f"{ratio:.2f}x", name
    c1, c32 = list(expected)[1], list(expected)[3]
    assert (rows[c1], rows[c32]) == ("3.26x", "2.07x")  # as BENCHMARKS.md quotes them
    assert rows["vLLM"] == "0.32.0, BF16 weights, torch CPU capability AVX512"
