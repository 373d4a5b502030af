"""GSM-style problems from reasoning-gym in lm-evaluation-harness's `gsm8k` format and its strict match."""

from __future__ import annotations

import pytest

from kvq.eval import gsm


@pytest.fixture(scope="module")
def problems() -> tuple[list[gsm.GsmProblem], list[gsm.GsmProblem]]:
    return gsm.load_problems(seed=0, num_shots=5, limit=40)


def test_problems_are_fixed_by_the_seed(problems) -> None:
    shots, scored = problems
    assert [p.index for p in shots] == [0, 1, 2, 3, 4] and [p.index for p in scored] == list(range(5, 45))
    again = gsm.load_problems(seed=0, num_shots=5, limit=3)[1]
    assert again == scored[:3]  # a smaller --limit scores a prefix of the same problems
    assert gsm.load_problems(seed=1, num_shots=5, limit=3)[1] != scored[:3]


def test_each_reference_is_the_solutions_final_answer(problems) -> None:
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(gsm.DATASET, seed=0, size=45)
    for problem in problems[1]:
        entry = dataset[problem.index]
        assert problem.solution.splitlines()[-1].startswith("#### ")
        assert problem.reference == entry["answer"].replace(",", "")
        assert not problem.question.endswith(gsm.QUESTION_SUFFIX) and problem.question in entry["question"]


def test_prompt_format_is_lm_evals(problems) -> None:
    shots, scored = problems
    text = gsm.prompt(scored[0], shots[:2])
    expected = (
        f"Question: {shots[0].question}\nAnswer: {shots[0].solution}\n\n"
        f"Question: {shots[1].question}\nAnswer: {shots[1].solution}\n\n"
        f"Question: {scored[0].question}\nAnswer:"
    )
    assert text == expected and gsm.prompt(scored[0], []) == f"Question: {scored[0].question}\nAnswer:"


@pytest.mark.parametrize(
    ("completion", "extracted", "answer"),
    [
        (" 3 + 4 = 7 apples\n#### 7", "7", "7"),
        (" costs $1,250.\n#### 1,250.", "1,250.", "1250"),  # lm-eval drops ',' and a final '.'
        ("#### -12 then #### 5", "-12", "-12"),  # take_first
        ("The answer is 7.", gsm.INVALID, "[invalid]"),  # strict: no '####', no credit
        ("####7", gsm.INVALID, "[invalid]"),
    ],
)
def test_strict_match_and_normalization(completion, extracted, answer) -> None:
    assert gsm.strict_match(completion) == extracted
    assert gsm.normalize(extracted) == answer


def test_is_correct(problems) -> None:
    problem = problems[1][0]
    answer = problem.solution.splitlines()[-1].removeprefix("#### ")
    assert gsm.is_correct(f" Some steps.\n#### {answer}\n\nQuestion:", problem)
    assert not gsm.is_correct(f" #### {answer}1", problem)
    assert not gsm.is_correct(f" The answer is {answer}.", problem)
