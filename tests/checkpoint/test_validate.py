"""kvq.checkpoint.validate: every fixture kvq reads or writes passes; each spoiled checkpoint of the corpus is
refused by its rule, naming the tensor or field, in one line; no config.json or shape makes it raise
anything but `KvqError` (property test over config fields and tensor shapes, headers only)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvq.checkpoint.header import TensorInfo
from kvq.checkpoint.reader import Checkpoint
from kvq.checkpoint.validate import checkpoint_mismatches, validate_dir, validate_tensors
from kvq.errors import KvqError
from tests.checkpoint.bad_checkpoints import CASES, FUZZ_FIELDS, FUZZ_VALUES, spoiled


def mismatches_of(path: Path) -> list:
    ckpt = Checkpoint.open(path)
    return checkpoint_mismatches(ckpt.config, ckpt.tensors, ckpt.root / "config.json")[1]


@pytest.mark.parametrize("arch", ["llama", "glm4_moe", "glm_moe_dsa", "deepseek_v3"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
def test_fixtures_match_their_config(tiny_checkpoint, arch, fmt):
    assert mismatches_of(tiny_checkpoint(arch, fmt)) == []
    assert validate_dir(tiny_checkpoint(arch, fmt)).model_type == arch


@pytest.mark.parametrize("arch", ["glm4_moe", "glm_moe_dsa"])
def test_compressed_outputs_match_their_config(compressed, arch):
    # pack-quantized experts (weight_packed + weight_scale) and FP8 float-quantized attention
    assert mismatches_of(compressed(arch, "fp8-block")) == []


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_spoiled_checkpoint_is_refused_by_its_rule(tiny_checkpoint, tmp_path, case):
    path = spoiled(tiny_checkpoint("llama", "bf16"), tmp_path / "model", case)
    found = mismatches_of(path)
    assert found and {m.rule for m in found} == {CASES[case].rule}
    assert any(CASES[case].names in f"{m.where} {m.message}" for m in found), found
    with pytest.raises(KvqError) as refused:
        validate_dir(path)
    assert "\n" not in str(refused.value) and str(path) in str(refused.value)


def test_hidden_size_transformers_cannot_split_is_one_line(tiny_checkpoint):
    ckpt = Checkpoint.open(tiny_checkpoint("llama", "bf16"))
    config = {**ckpt.config, "num_attention_heads": 6, "num_key_value_heads": 6}  # hidden 256
    found = checkpoint_mismatches(config, ckpt.tensors, "config.json")[1]
    assert [m.rule for m in found] == ["config"] and "not a multiple" in found[0].message


def test_tied_embeddings_need_no_lm_head(tiny_checkpoint):
    ckpt = Checkpoint.open(tiny_checkpoint("llama", "bf16"))
    tensors = {n: i for n, i in ckpt.tensors.items() if n != "lm_head.weight"}
    untied = checkpoint_mismatches(ckpt.config, tensors, "config.json")[1]
    assert [(m.rule, m.where) for m in untied] == [("missing", "lm_head.weight")]
    tied = {**ckpt.config, "tie_word_embeddings": True}
    assert checkpoint_mismatches(tied, tensors, "config.json")[1] == []


@pytest.fixture(scope="module", params=["llama", "glm4_moe", "glm_moe_dsa"])
def headers(tiny_checkpoint, request) -> tuple[dict, dict[str, TensorInfo]]:
    ckpt = Checkpoint.open(tiny_checkpoint(request.param, "bf16"))
    return ckpt.config, ckpt.tensors


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    edits=st.dictionaries(st.sampled_from(FUZZ_FIELDS), FUZZ_VALUES, max_size=3),
    shape_edit=st.tuples(st.integers(0, 20), st.lists(st.integers(0, 5000), max_size=3)),
)
def test_any_config_or_shape_is_refused_in_one_line_or_accepted(headers, edits, shape_edit):
    config, tensors = headers
    config = {**config, **edits}
    index, shape = shape_edit
    name = sorted(tensors)[index % len(tensors)]
    tensors = {**tensors, name: dataclasses.replace(tensors[name], shape=tuple(shape))}
    try:
        validate_tensors(config, tensors, Path("ckpt"))
    except KvqError as e:
        assert "\n" not in str(e)
