"""lm-evaluation-harness dataset hook of `gsm_symbolic.yaml`: reasoning-gym's `gsm_symbolic` problems (GSM8K
questions instantiated from templates under a seed) as lm-eval's `gsm8k` fields, generated in memory.

Each problem's worked solution ends in "#### <answer>" (GSM8K's answer format); its last line is rewritten
with the problem's `answer` (the solution's own may read "8.0" where the answer is 8), and the instruction
reasoning-gym appends to every question is removed (GSM8K's questions have none). Problems 0..4 of the
seed are the `train` split (the shots), the next `num_problems` the `test` split.
Imports datasets and reasoning_gym.
"""

from __future__ import annotations

from typing import Any

import datasets

DATASET = "gsm_symbolic"
QUESTION_SUFFIX = " Give the result as your final answer. Do not include units."
NUM_SHOTS = 5  # lm-eval's gsm8k: num_fewshot 5


def load(seed: int = 0, num_problems: int = 1319, **metadata: Any) -> datasets.DatasetDict:
    """`train` (the shots) and `test` splits of {question, answer}; lm-eval passes the task's metadata."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(
            "reasoning-gym generates the gsm_symbolic problems: pip install reasoning-gym (kvq's data extra)"
        ) from e
    size = NUM_SHOTS + int(num_problems)
    dataset = reasoning_gym.create_dataset(DATASET, seed=int(seed), size=size)
    rows = []
    for index in range(size):
        entry = dataset[index]
        steps = entry["metadata"]["answer_cot"].rsplit("\n#### ", 1)[0]
        rows.append(
            {
                "index": index,
                "question": entry["question"].removesuffix(QUESTION_SUFFIX),
                "answer": f"{steps}\n#### {entry['answer']}",
            }
        )
    return datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(rows[:NUM_SHOTS]),
            "test": datasets.Dataset.from_list(rows[NUM_SHOTS:]),
        }
    )
