"""Faults the drill was not tuned to (`kvq.drill.random_faults`: the slip, request, logical page, page,
slot and offset drawn from a seed), in `tags` mode: every one is caught (only the requests in the slip
stopped, before a forward reads what it named, everyone else's tokens and fp32 logits identical to a
fault-free run repeating the departures) or harmless (a refused free), on the tiny llama and the tiny
glm_moe_dsa (MLA latent pages with DSA index keys). The classifier itself is shown to fail a slip that
gets through (a byte fault in `tags`, a misdirected write in `off`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvq.drill.faults import FAULTS
from kvq.drill.random_faults import KINDS, classify, random_fault
from kvq.drill.workload import drill_engine, run_drill

PAGE_SIZE = 4


make_engine = drill_engine


def outcomes(path: Path, seeds: range) -> dict[int, str]:
    out = {}
    for seed in seeds:
        fault = random_fault(seed).fault
        engine = make_engine(path, fault.mode)
        run = run_drill(engine, fault, catch=True)
        replay = run_drill(make_engine(path, "off"), departures=run.departures, catch=True)
        out[seed] = classify(engine, run, replay, fault)
    return out


def test_the_draws_cover_every_kind_of_slip() -> None:
    assert {random_fault(seed).fault.name.split("_", 2)[2] for seed in range(40)} == set(KINDS)


@pytest.mark.slow
def test_random_faults_on_llama_are_caught_or_harmless(tiny_checkpoint) -> None:
    seen = outcomes(tiny_checkpoint("llama", "bf16"), range(40))
    assert set(seen.values()) <= {"caught", "harmless"}, {s: o for s, o in seen.items() if o != "caught"}
    assert sum(o == "caught" for o in seen.values()) >= 30  # seen on seeds 0-29: 23 caught, 7 refused frees


@pytest.mark.slow
def test_random_faults_on_mla_are_caught_or_harmless(tiny_checkpoint) -> None:
    seen = outcomes(tiny_checkpoint("glm_moe_dsa", "bf16"), range(40, 52))
    assert set(seen.values()) <= {"caught", "harmless"}, seen


def test_the_classifier_fails_what_gets_through(tiny_checkpoint) -> None:
    path = tiny_checkpoint("llama", "bf16")
    misdirected = next(f for f in FAULTS if f.name == "misdirected_write")  # e's K/V over c's first page
    engine = make_engine(path, "off")
    run = run_drill(engine, misdirected, catch=True)
    replay = run_drill(make_engine(path, "off"), departures=run.departures)
    assert classify(engine, run, replay, misdirected) == "leaked"
    stray = next(f for f in FAULTS if f.name == "stray_write")  # over e's own sealed page: tags cannot see it
    engine = make_engine(path, "tags")
    run = run_drill(engine, stray)
    replay = run_drill(make_engine(path, "off"), departures=run.departures)
    assert classify(engine, run, replay, stray) == "missed"
