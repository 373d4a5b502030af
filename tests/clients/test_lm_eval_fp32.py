"""lm-evaluation-harness scores a `kvq serve` in fp32 reference mode exactly as its own `hf` backend does.

The embedded SmolLM2 (BF16 checkpoint) served with activations in fp32, against lm-eval's transformers
backend at float32 on the same directory: the multiple-choice MMLU task through `local-completions`
(prompt log-probabilities: `echo` + `logprobs`), and the 1-shot generation task through
`local-completions` and `local-chat-completions`. Scores are equal; item by item, each choice's
log-likelihood agrees within LOGLIKELIHOOD_ATOL (fp32 sums in another order) and generated texts are equal.
"""

from __future__ import annotations

import pytest

from tests.clients.lm_eval_runs import (
    GENERATION,
    MULTIPLE_CHOICE,
    Scored,
    chat_args,
    completions_args,
    evaluate,
    hf_args,
)
from tests.serve.conftest import Running

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

NUM_CHOICE_ITEMS = 20
NUM_GENERATION_ITEMS = 8
LOGLIKELIHOOD_ATOL = 1e-4  # measured: 2.7e-5 at most on these items


@pytest.fixture(scope="module")
def hf_multiple_choice(smollm2):
    return evaluate("hf", hf_args(smollm2.bf16, "float32"), MULTIPLE_CHOICE, NUM_CHOICE_ITEMS)


def test_multiple_choice_through_completions_equals_hf(
    fp32_server: Running, smollm2, hf_multiple_choice: Scored
) -> None:
    args = completions_args(fp32_server.url, smollm2.bf16)
    served = evaluate("local-completions", args, MULTIPLE_CHOICE, NUM_CHOICE_ITEMS)
    assert served.score == hf_multiple_choice.score
    assert [s["acc"] for s in served.samples] == [s["acc"] for s in hf_multiple_choice.samples]
    for ours, theirs in zip(served.loglikelihoods(), hf_multiple_choice.loglikelihoods(), strict=True):
        assert ours == pytest.approx(theirs, abs=LOGLIKELIHOOD_ATOL)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_generation_equals_hf(fp32_server: Running, smollm2, chat: bool) -> None:
    args = chat_args(fp32_server.url) if chat else completions_args(fp32_server.url, smollm2.bf16)
    backend = "local-chat-completions" if chat else "local-completions"
    served = evaluate(backend, args, GENERATION, NUM_GENERATION_ITEMS, chat=chat)
    hf = evaluate("hf", hf_args(smollm2.bf16, "float32"), GENERATION, NUM_GENERATION_ITEMS, chat=chat)
    assert served.generations() == hf.generations()
    assert served.score == hf.score
    assert any(text.strip() for text in served.generations())  # the model answered, not only stopped
