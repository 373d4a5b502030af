"""kvq check on checkpoints no engine loads: each spoiled checkpoint of the corpus is refused by every engine
under the `checkpoint.*` rule that names it, and --tp is refused where an engine's loader cannot split the
heads, the KV heads or the layers (and allowed where it can: vLLM replicates KV heads, kvq does not)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvq.check import ENGINES, check_checkpoint
from kvq.errors import KvqError
from tests.check.edit import errors
from tests.checkpoint.bad_checkpoints import CASES, FUZZ_FIELDS, FUZZ_VALUES, heads_checkpoint, spoiled
from tests.test_cli_errors import run_kvq_in_process


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_engine_loads_a_spoiled_checkpoint(tiny_checkpoint, tmp_path, case):
    path = spoiled(tiny_checkpoint("llama", "bf16"), tmp_path / "model", case)
    report = check_checkpoint(path)
    rule = f"checkpoint.{CASES[case].rule}"
    for engine in ENGINES:
        assert errors(report.verdict(engine)) == {rule}, (engine, report.verdict(engine).findings)
    messages = [f"{f.where} {f.message}" for f in report.verdict("vllm").findings]
    assert any(CASES[case].names in m for m in messages), messages


def test_check_command_names_the_rule(tiny_checkpoint, tmp_path):
    path = spoiled(tiny_checkpoint("llama", "bf16"), tmp_path / "model", "more-layers-in-config")
    result = run_kvq_in_process("check", str(path), "--json")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    engines = json.loads(result.stdout)["engines"]
    assert [e["loads"] for e in engines] == [False] * len(ENGINES)
    assert {f["rule"] for e in engines for f in e["findings"]} == {"checkpoint.layers"}


@pytest.fixture(scope="module")
def six_heads(tmp_path_factory):
    """6 attention heads: 2 KV heads, and 3 KV heads."""
    root = tmp_path_factory.mktemp("heads")
    return {kv: heads_checkpoint(root / f"kv{kv}", 6, kv) for kv in (2, 3)}


# (KV heads, --tp) -> the error rules of vllm, sglang, kvq (transformers does not split).
TP_CASES = {
    (2, 4): ({"vllm.tp-heads"}, {"sglang.tp-heads"}, {"kvq.tp-split"}),
    (3, 2): ({"vllm.tp-kv-heads"}, {"sglang.tp-kv-heads"}, {"kvq.tp-split"}),
    (3, 3): (set(), set(), set()),
    (3, 6): (set(), set(), {"kvq.tp-split"}),  # vLLM/SGLang replicate 3 KV heads over 6 ranks; kvq cannot
    (2, 1): (set(), set(), set()),
}


@pytest.mark.parametrize(("kv_heads", "tp"), sorted(TP_CASES))
def test_tp_rules_per_engine(six_heads, kv_heads, tp):
    report = check_checkpoint(six_heads[kv_heads], tp=tp)
    found = tuple(errors(report.verdict(e)) for e in ("vllm", "sglang", "kvq"))
    assert found == TP_CASES[(kv_heads, tp)]
    assert report.loads("transformers")


def test_kvq_tp_refusal_says_what_does_not_split(six_heads):
    kvq = check_checkpoint(six_heads[3], ["kvq"], tp=6).verdict("kvq")
    assert any(
        f.where == "config.json num_key_value_heads" and "3 does not split over 6" in f.message
        for f in kvq.findings
    ), kvq.findings


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.dictionaries(st.sampled_from(FUZZ_FIELDS), FUZZ_VALUES, max_size=3), tp=st.integers(1, 8))
def test_any_config_gets_a_verdict_or_one_line(tiny_checkpoint, tmp_path_factory, edits, tp):
    src, root = tiny_checkpoint("llama", "bf16"), tmp_path_factory.mktemp("fuzz")
    for file in src.iterdir():
        if file.name != "config.json":
            (root / file.name).symlink_to(file)
    config = {**json.loads((src / "config.json").read_text()), **edits}
    (root / "config.json").write_text(json.dumps(config))
    try:
        report = check_checkpoint(root, tp=tp)
    except KvqError as e:
        assert "\n" not in str(e)
        return
    assert len(report.verdicts) == len(ENGINES)
