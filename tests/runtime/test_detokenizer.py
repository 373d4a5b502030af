"""The incremental detokenizer gives, token by token, exactly the text of a full decode (real tokenizers,
real text with multi-byte characters, special tokens), and stop strings cut where a full search would.
"""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from kvq.data.texts import load_texts
from kvq.runtime.detokenizer import CompletionText, IncrementalDetokenizer

UNICODE = "Héllo wörld 🤖 — ünïcode\n  spaces\tand 日本語のテキスト, emoji 👩‍👩‍👧 and ½ of π."


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return AutoTokenizer.from_pretrained(smollm2.bf16)


def real_text() -> str:
    return "\n".join(load_texts()[:3])[:4000] + UNICODE


def test_token_by_token_text_equals_a_full_decode(tokenizer) -> None:
    ids = tokenizer.encode(real_text(), add_special_tokens=False)
    ids[len(ids) // 2 : len(ids) // 2] = [tokenizer.eos_token_id]  # a special token inside: skipped
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add(t) for t in ids] + [detokenizer.flush()]
    assert "".join(deltas) == detokenizer.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert "" in deltas[:-1]  # multi-byte characters were held back until complete


def test_prefixes_decode_as_a_full_decode_would(tokenizer) -> None:
    """At every point, text + flush equals decoding the tokens so far (incomplete characters as U+FFFD)."""
    ids = tokenizer.encode(UNICODE, add_special_tokens=False)
    for n in range(1, len(ids) + 1):
        detokenizer = IncrementalDetokenizer(tokenizer)
        text = "".join(detokenizer.add(t) for t in ids[:n]) + detokenizer.flush()
        assert text == tokenizer.decode(ids[:n], skip_special_tokens=True), n


def test_stop_strings_cut_where_a_full_search_does(tokenizer) -> None:
    text = real_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids)
    rng = random.Random(0)
    for _ in range(20):
        start = rng.randrange(len(full) // 2, len(full) - 8)
        stop = full[start : start + rng.randrange(1, 8)]
        completion = CompletionText(tokenizer, ["never appears \x00", stop])
        taken = []
        for i, t in enumerate(ids):
            is_stopped = completion.add(t, is_last=i == len(ids) - 1)
            shown, delta = completion.take(is_stopped)
            taken.append(delta)
            assert not stop or stop not in shown
            if is_stopped:
                break
        assert completion.text == full[: full.index(stop)] == "".join(taken)
