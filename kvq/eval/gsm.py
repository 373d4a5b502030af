"""GSM8K-style exact match on `reasoning-gym`'s `gsm_symbolic` problems, in lm-evaluation-harness's `gsm8k`
format: k-shot, greedy, the answer extracted by its strict-match filter.

`gsm_symbolic` instantiates GSM8K problems from templates with a seed; each comes with a worked solution
ending in "#### <answer>" (GSM8K's answer format), which is what a shot shows and what the reference is
taken from. Its final line is rewritten with the problem's `answer` (the solution's own may read "8.0"
where the answer is 8; GSM8K's answers are plain numbers). Problems 0..k-1 of the seed are the shots, the
next ones are scored. reasoning-gym appends an instruction of its own to every question
(`QUESTION_SUFFIX`); it is removed, as GSM8K questions have none.
Imports kvq.runtime and kvq.errors (reasoning_gym lazily).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvq.errors import KvqError
from kvq.runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from kvq.runtime.engine import Engine

DATASET = "gsm_symbolic"
QUESTION_SUFFIX = " Give the result as your final answer. Do not include units."
# lm-evaluation-harness lm_eval/tasks/gsm8k/gsm8k.yaml (metadata version 3.0):
#   doc_to_text: "Question: {{question}}\nAnswer:"; doc_to_target: "{{answer}}"; num_fewshot: 5
#   generation_kwargs: until ["Question:", "</s>", "<|im_end|>"], do_sample false, temperature 0.0
#   filter "strict-match": regex "#### (\-?[0-9\.\,]+)", then take_first (no match: "[invalid]")
#   metric exact_match: ignore_case true, regexes_to_ignore [",", "\$", "(?s).*#### ", "\.$"]
#   max_gen_toks: lm-eval's default for generate_until, 256
STOP = ("Question:", "</s>", "<|im_end|>")
STRICT_MATCH = re.compile(r"#### (\-?[0-9\.\,]+)")
INVALID = "[invalid]"
IGNORED = tuple(re.compile(p) for p in (",", r"\$", r"(?s).*#### ", r"\.$"))
TARGET_DELIMITER = " "
FEWSHOT_DELIMITER = "\n\n"
MAX_GEN_TOKS = 256


@dataclass(frozen=True)
class GsmProblem:
    index: int  # reasoning-gym's index under the seed
    question: str
    solution: str  # the worked solution, ending in "#### <answer>"

    @property
    def reference(self) -> str:
        return normalize(self.solution)


def load_problems(seed: int, num_shots: int, limit: int) -> tuple[list[GsmProblem], list[GsmProblem]]:
    """(shots, problems to score) of `gsm_symbolic` under `seed`."""
    if importlib.util.find_spec("reasoning_gym") is None:
        raise KvqError(
            "reasoning-gym is not installed; it generates the GSM-style problems: "
            "pip install reasoning-gym, or leave gsm out of --tasks"
        )
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(DATASET, seed=seed, size=num_shots + limit)
    problems = []
    for index in range(num_shots + limit):
        entry = dataset[index]
        question = entry["question"].removesuffix(QUESTION_SUFFIX)
        steps = entry["metadata"]["answer_cot"].rsplit("\n#### ", 1)[0]
        problems.append(GsmProblem(index, question, f"{steps}\n#### {entry['answer']}"))
    return problems[:num_shots], problems[num_shots:]


def question_text(problem: GsmProblem) -> str:
    return f"Question: {problem.question}\nAnswer:"


def prompt(problem: GsmProblem, shots: list[GsmProblem]) -> str:
    examples = "".join(question_text(s) + TARGET_DELIMITER + s.solution + FEWSHOT_DELIMITER for s in shots)
    return examples + question_text(problem)


def strict_match(completion: str) -> str:
    """The first "#### <number>" of a completion (lm-eval's strict-match filter), else "[invalid]"."""
    found = STRICT_MATCH.findall(completion)
    return found[0].strip() if found else INVALID


def normalize(text: str) -> str:
    """lm-eval's exact_match preprocessing: drop the ignored patterns, then lower-case."""
    for pattern in IGNORED:
        text = pattern.sub("", text)
    return text.lower()


def is_correct(completion: str, problem: GsmProblem) -> bool:
    return normalize(strict_match(completion)) == problem.reference


def generate(
    engine: Engine,
    prompts: list[str],
    max_tokens: int = MAX_GEN_TOKS,
    on_finished: Callable[[int], None] | None = None,
) -> list[str]:
    """Greedy completions, stopped at lm-eval's `until` strings (or EOS, or `max_tokens`); prompts are
    encoded without special tokens and cut from the left to leave `max_tokens` of context (as lm-eval)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=list(STOP))
    room = engine.max_model_len - max_tokens
    if room < 1:
        raise KvqError(f"--gsm-max-tokens {max_tokens} leaves no room for a prompt in {engine.max_model_len}")
    ids = [engine.tokenizer.encode(p, add_special_tokens=False)[-room:] for p in prompts]
    request_ids = [engine.add_request(token_ids, params) for token_ids in ids]
    texts: dict[int, str] = {}
    while len(texts) < len(request_ids):
        finished = [out for out in engine.step() if out.finished]
        for out in finished:
            if out.finish_reason == "error":
                raise KvqError(f"a GSM completion failed: {out.error}")
            texts[out.request_id] = out.text
        if finished and on_finished is not None:
            on_finished(len(finished))
    return [texts[r] for r in request_ids]
