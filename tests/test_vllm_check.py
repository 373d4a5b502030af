"""kvq check's vLLM answers against vLLM itself (opt-in: `make test-vllm`), config-level: runs on any CPU.

On kvq's outputs of every MoE fixture (glm4_moe, glm_moe_dsa from FP8-block sources), both targets,
group sizes 32/64/128, and on llm-compressor's and a Kimi-native checkpoint: vLLM's own
`CompressedTensorsConfig` resolves every Linear layer's scheme as kvq check predicts, the MoE layers get
the method kvq predicts, and for --tp 1, 2 and 4 vLLM's `check_moe_marlin_supports_config` and
`validate_fp8_block_shape` agree with kvq check. vLLM runs in its own venv (tests/vllm_schemes.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvq.check import vllm_rules
from kvq.check.ct_layers import class_name, parallel_style
from kvq.check.view import LINEAR, MOE, open_view
from tests.check.kimi import build_kimi_int4
from tests.test_vllm_cpu import ROOT, VLLM_PYTHON

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON}: run `make test-vllm`"
    ),
]
TPS = (1, 2, 4)


def question_and_prediction(path: Path) -> tuple[dict, dict]:
    """What to ask vLLM about one checkpoint, and kvq check's answers to the same questions."""
    view = open_view(path)
    verdicts = {tp: vllm_rules.check(view, tp) for tp in TPS}
    linear = [
        (layer.name, class_name(layer))
        for layer in view.layers
        if layer.kind == LINEAR and not layer.is_always_dense
    ]
    moe = [layer.name for layer in view.layers if layer.kind == MOE]
    question: dict = {
        "quantization_config": view.quant,
        "linear": linear,
        "moe": moe,
        "marlin": [],
        "fp8_block": [],
    }
    predicted: dict = {"schemes": {}, "moe": {}, "marlin": {}, "fp8_block": {}}
    for name, _ in linear:
        predicted["schemes"][name] = verdicts[1].schemes[name]
    for name in moe:
        predicted["moe"][name] = verdicts[1].schemes[name]
    group = next(iter(view.quant.get("config_groups", {}).values()), {}).get("weights", {}).get("group_size")
    hidden, intermediate = view.moe_dims()
    for tp, verdict in verdicts.items():
        for name in verdict.marlin_moe:
            question["marlin"].append((name, tp, hidden, intermediate // tp, group))
            predicted["marlin"][f"{name}@{tp}"] = verdict.marlin_moe[name]
        failing = {f.where for f in verdict.findings if f.rule == "vllm.fp8-block-tp"}
        for layer in view.layers:
            if verdict.schemes.get(layer.name) != "CompressedTensorsW8A8Fp8":
                continue
            style, outs = parallel_style(layer), [view.linears[s].shape[0] for s in layer.shards]
            in_size, split = (
                view.linears[layer.shards[0]].shape[1],
                1 if parallel_style(layer) == "replicated" else tp,
            )
            in_per_rank = in_size // split if style == "row" else in_size
            outs_per_rank = [o // split for o in outs] if style == "column" else outs
            question["fp8_block"].append(
                (layer.name, split, in_size, in_per_rank, sum(outs), outs_per_rank, [128, 128])
            )
            predicted["fp8_block"][f"{layer.name}@{split}"] = "error" if layer.name in failing else "ok"
    return question, predicted


@pytest.fixture(scope="module")
def checkpoints(compressed, model_free, tmp_path_factory) -> dict[str, Path]:
    out = {
        f"{arch}-{target}-g{group}": compressed(arch, "fp8-block", group_size=group, target=target)
        for arch in ("glm4_moe", "glm_moe_dsa")
        for target in ("vllm", "sglang")
        for group in (32, 64, 128)
    }
    out["model_free_ptq-glm4_moe"] = model_free("glm4_moe", "fp8-block")
    out["kimi-int4"] = build_kimi_int4(tmp_path_factory.mktemp("kimi") / "model")
    return out


def test_vllm_resolves_schemes_marlin_and_fp8_blocks_as_kvq_check_predicts(checkpoints):
    names = list(checkpoints)
    pairs = [question_and_prediction(checkpoints[n]) for n in names]
    result = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_schemes.py")],
        input=json.dumps([q for q, _ in pairs]),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("ANSWERS ")]
    assert result.returncode == 0 and lines, result.stderr[-4000:]
    answers = json.loads(lines[-1].removeprefix("ANSWERS "))
    for name, (_, predicted), found in zip(names, pairs, answers, strict=True):
        assert found["schemes"] == predicted["schemes"], name
        assert found["moe"] == predicted["moe"], name
        assert found["marlin"] == predicted["marlin"], name
        verdicts = {k: "error" if v.startswith("error") else "ok" for k, v in found["fp8_block"].items()}
        assert verdicts == predicted["fp8_block"], name
    assert any(v is False for _, p in pairs for v in p["marlin"].values())  # both answers were exercised
    assert any(v == "error" for _, p in pairs for v in p["fp8_block"].values())
