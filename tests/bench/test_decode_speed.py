"""`decode_tok_s` on a fake clock: prefill cancels out of t(N) - t(1), and a repeat whose t(1) reaches t(N)
(a loaded machine, short N) still gives a positive speed (N tokens over t(N)), never a negative one."""

from __future__ import annotations

import time

import pytest

from kvq.bench.decode_speed import decode_tok_s


def test_prefill_cancels_and_noise_never_makes_a_negative_speed(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def steady(n: int) -> None:  # 20 ms of prefill, then 5 ms a token
        now[0] += 0.020 + 0.005 * n

    def flat(n: int) -> None:  # 30 ms whatever N: t(N) - 2 t(1) < 0
        now[0] += 0.030

    runs = decode_tok_s({"steady": steady, "flat": flat}, num_seqs=2, new_tokens=9, repeats=2)
    assert runs["steady"] == pytest.approx([2 * 8 / 0.040] * 2)  # 2 sequences x 8 tokens in 40 ms
    assert runs["flat"] == pytest.approx([2 * 9 / 0.030] * 2)  # N tokens over t(N)
