"""`kvq bench gptq`'s scoring step on the tiny llama: it runs a real `kvq eval` (text only, BF16 KV) and reads
the perplexity from the JSON `kvq eval` writes, so a change of that JSON's layout fails here, not an hour
into the bench."""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvq.bench.gptq_quality import GptqQualityConfig, perplexity


def test_perplexity_is_the_one_kvq_eval_reports(tiny_checkpoint, tmp_path: Path) -> None:
    model = tiny_checkpoint("llama", "bf16")
    out = tmp_path / "eval.json"
    value = perplexity(GptqQualityConfig(eval_windows=2, eval_seq_len=32, threads=1), model, None, out)
    report = json.loads(out.read_text())
    assert report["settings"]["tasks"] == ["text"] and report["settings"]["num_windows"] == 2
    text = report["runs"][0]["items"]["text"]
    # perplexity = exp(total NLL / predicted tokens) over the scored windows
    assert math.isclose(value, math.exp(sum(text["nll"]) / (text["num_predicted"] * 2)), rel_tol=1e-6)
    assert value > 1
