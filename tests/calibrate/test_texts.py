"""kvq.data: the bundled Wikipedia articles, .txt / .jsonl documents, and the held-out split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvq.data.texts import is_held_out, load_texts, read_documents
from kvq.data.wikipedia import wikipedia_articles
from kvq.errors import KvqError


def test_wikipedia_articles_are_real_plain_text() -> None:
    articles = dict(wikipedia_articles())
    assert len(articles) == 100
    assert "Anarchism" in articles and "Achilles" in articles
    text = articles["Achilles"]
    assert "Trojan War" in text and "'''" not in text and "[[" not in text
    assert all(not t.upper().startswith("#REDIRECT") and len(t) >= 2000 for t in articles.values())


def test_splits_partition_the_default_corpus() -> None:
    everything = load_texts(None)
    calibration, held_out = load_texts(None, "calibration"), load_texts(None, "held_out")
    assert set(calibration).isdisjoint(held_out)
    assert sorted(calibration + held_out) == sorted(everything)
    assert 5 <= len(held_out) <= 20  # about one in ten
    assert all(is_held_out(t) for t in held_out) and not any(is_held_out(t) for t in calibration)


def test_txt_and_jsonl_documents(tmp_path: Path) -> None:
    txt = tmp_path / "a.txt"
    txt.write_text("first doc\nstill first\n\n\n  \nsecond doc\n")
    assert read_documents(txt) == ["first doc\nstill first", "second doc"]
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text(json.dumps({"text": "one", "id": 1}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    assert load_texts(jsonl) == ["one", "two"]


def test_unknown_split() -> None:
    with pytest.raises(KvqError, match="split 'test' is unknown"):
        load_texts(None, "test")
