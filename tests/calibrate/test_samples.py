"""Calibration samples: fixed-length windows of the token stream, chosen by a seed, fingerprinted."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvq.calibrate.samples import build_samples, token_fingerprint, token_stream
from kvq.errors import KvqError
from kvq.fixtures.tiny_tokenizer import tiny_tokenizer

TEXTS = [f"Document {i} talks about the history of the river and its {i} bridges. " * 20 for i in range(6)]


def test_windows_of_the_stream_with_bos() -> None:
    tokenizer = tiny_tokenizer()
    samples = build_samples(TEXTS, tokenizer, num_samples=5, seq_len=33, seed=0, source="t")
    assert samples.input_ids.shape == (5, 33) and samples.input_ids.dtype == torch.int64
    assert (samples.input_ids[:, 0] == tokenizer.bos_token_id).all()
    stream = token_stream(TEXTS, tokenizer).tolist()
    assert stream.count(tokenizer.eos_token_id) == len(TEXTS) - 1
    windows = {tuple(stream[i * 32 : (i + 1) * 32]) for i in range(len(stream) // 32)}
    assert all(tuple(row[1:].tolist()) in windows for row in samples.input_ids)
    assert len({tuple(r.tolist()) for r in samples.input_ids}) == 5  # distinct windows
    assert samples.num_texts == 6 and samples.num_stream_tokens == len(stream)


def test_seeded_and_fingerprinted() -> None:
    tokenizer = tiny_tokenizer()
    a = build_samples(TEXTS, tokenizer, num_samples=4, seq_len=16, seed=3, source="t")
    b = build_samples(TEXTS, tokenizer, num_samples=4, seq_len=16, seed=3, source="t")
    c = build_samples(TEXTS, tokenizer, num_samples=4, seq_len=16, seed=4, source="t")
    assert torch.equal(a.input_ids, b.input_ids) and a.fingerprint == b.fingerprint
    assert not torch.equal(a.input_ids, c.input_ids) and a.fingerprint != c.fingerprint
    ids = torch.tensor([[1, 2], [3, 258]])
    expected = hashlib.sha256(b"".join(int(v).to_bytes(8, "little") for v in [1, 2, 3, 258])).hexdigest()
    assert token_fingerprint(ids) == expected


def test_too_little_text() -> None:
    with pytest.raises(KvqError, match=r"enough for \d+ sample\(s\) of 512 tokens but 64 were asked for"):
        build_samples(TEXTS, tiny_tokenizer(), num_samples=64, seq_len=512, seed=0, source="t")
