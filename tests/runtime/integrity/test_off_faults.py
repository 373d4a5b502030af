"""What `--kv-integrity off` (no tracker) lets a fault do to other requests before the engine stops: every
fault of the drill (`kvq.drill.faults`) run with `off` on the tiny llama, and each request other than the
fault's targets (the requests whose bookkeeping, batch or pages the slip belongs to) compared with a
fault-free run repeating the same departures, on the tokens it emitted until the run ended or the block
manager's bookkeeping assert stopped the engine. The outcome of every fault is pinned in `OFF_OUTCOMES`,
and docs/integrity.md ("What `off` lets through") must list the same."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvq.drill.faults import FAULTS, Fault
from kvq.drill.workload import DrillRun, drill_engine, request_names, run_drill
from kvq.runtime.engine import Engine

PAGE_SIZE = 4
DOC = Path(__file__).parents[3] / "docs" / "integrity.md"

UNTOUCHED, CORRUPTED = "bystander untouched", "bystander corrupted"
LOGITS_ONLY = "bystander logits changed, tokens not"  # the K/V landed, the fixture's argmax held

# fault -> its targets (the requests the slip belongs to; a byte fault's: the page's readers)
TARGETS: dict[str, tuple[str, ...]] = {
    "premature_free": ("e",),
    "premature_free_sealing": ("d",),
    "double_free": ("b",),
    "stale_prefix_hit": ("f",),
    "hash_collision": ("k",),
    "off_by_one": ("d",),
    "seal_wrong_entry": ("d",),
    "seal_swap": ("d", "e"),
    "row_one_longer": ("e",),
    "prefix_unwritten": ("h",),
    "misdirected_write": ("e",),
    "slot_one_off": ("e",),
    "slot_one_off_prefill": ("h",),
    "position_one_off": ("e",),
    "context_one_too_long": ("e",),
    "forced_preemption": ("e",),
    "recompute_skips_token": ("e",),
    "abort_mid_step": ("e",),
    "late_write": ("e",),
    "late_store_after_abort": ("e",),
    "late_store_after_preemption": ("e",),
    "stray_write": ("e",),
    "bit_flip": ("e",),
    "bit_flip_shared": ("c", "d", "h", "i", "j"),
}

# fault -> (outcome for the bystanders, the bystanders it names, whether the engine stops)
OFF_OUTCOMES: dict[str, tuple[str, tuple[str, ...], bool]] = {
    "premature_free": (UNTOUCHED, (), True),
    "premature_free_sealing": (CORRUPTED, ("f",), True),
    "double_free": (UNTOUCHED, (), True),
    "stale_prefix_hit": (UNTOUCHED, (), False),
    "hash_collision": (UNTOUCHED, (), False),
    "off_by_one": (UNTOUCHED, (), True),
    "seal_wrong_entry": (UNTOUCHED, (), True),
    "seal_swap": (UNTOUCHED, (), False),
    "row_one_longer": (UNTOUCHED, (), True),
    "prefix_unwritten": (CORRUPTED, ("c", "d", "i", "j"), True),
    "misdirected_write": (CORRUPTED, ("d", "h", "i", "j"), False),
    "slot_one_off": (UNTOUCHED, (), False),
    "slot_one_off_prefill": (CORRUPTED, ("i", "j"), False),
    "position_one_off": (UNTOUCHED, (), False),
    "context_one_too_long": (UNTOUCHED, (), False),
    "forced_preemption": (UNTOUCHED, (), False),
    "recompute_skips_token": (UNTOUCHED, (), False),
    "abort_mid_step": (UNTOUCHED, (), False),
    "late_write": (LOGITS_ONLY, ("j",), False),
    "late_store_after_abort": (CORRUPTED, ("j",), False),
    "late_store_after_preemption": (UNTOUCHED, (), False),
    "stray_write": (UNTOUCHED, (), False),
    "bit_flip": (UNTOUCHED, (), False),
    "bit_flip_shared": (UNTOUCHED, (), False),
}


@pytest.fixture(scope="module")
def llama(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", "bf16")


def engine_on_used_memory(model: Path) -> Engine:
    """A drill engine in `off` whose pages hold the same stale bytes in every run: a page read before it
    is written (`prefix_unwritten`) reads them, not whatever the allocator returned (in a process that
    ran this workload before, that can be the very K/V the page should hold)."""
    engine = drill_engine(model, "off")
    pool = engine.kv_pool
    pool.storage[:, :, : pool.zero_page].fill_(1)  # [L, C, P, page_size, ...]; the zero page stays zeros
    return engine


def changed(run: DrillRun, replay: DrillRun, names: set[str]) -> tuple[set[str], set[str]]:
    """Of `names`: those whose emitted tokens, and those whose fp32 logits, differ from `replay`'s over
    what `run` saw before it ended."""

    def differs(seen: list, fault_free: list) -> bool:
        return seen != fault_free[: len(seen)]

    tokens = {n for n in names if differs(run.tokens.get(n, []), replay.tokens.get(n, []))}
    logits = {n for n in names if differs(run.logits.get(n, []), replay.logits.get(n, []))}
    return tokens, logits


def test_every_fault_has_a_pinned_outcome() -> None:
    assert set(OFF_OUTCOMES) == set(TARGETS) == {f.name for f in FAULTS}


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_what_off_lets_a_fault_do_to_bystanders(llama: Path, fault: Fault) -> None:
    run = run_drill(engine_on_used_memory(llama), fault, catch=True)
    replay = run_drill(engine_on_used_memory(llama), departures=run.departures)
    assert run.error is None or isinstance(run.error, AssertionError), repr(run.error)
    bystanders = request_names(PAGE_SIZE) - set(TARGETS[fault.name])
    tokens, logits = changed(run, replay, bystanders)
    outcome = CORRUPTED if tokens else LOGITS_ONLY if logits else UNTOUCHED
    found = (outcome, tuple(sorted(tokens or logits)), run.error is not None)
    assert found == OFF_OUTCOMES[fault.name], (fault.name, run.error)


def test_the_docs_list_the_same_outcomes() -> None:
    """docs/integrity.md's table under "What `off` lets through": `| fault | outcome | ... |` rows."""
    text = DOC.read_text()
    section = text.split("## What `off` lets through", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+?) \| ([^|]*?) \| (yes|no) \|", section, flags=re.MULTILINE)
    documented = {name: (outcome, who, stops) for name, outcome, who, stops in rows}
    expected = {
        name: (outcome, ", ".join(who) or "-", "yes" if stops else "no")
        for name, (outcome, who, stops) in OFF_OUTCOMES.items()
    }
    assert documented == expected
