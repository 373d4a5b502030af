"""OpenAI's and vLLM's logit adjustments on one row: bias, presence/frequency and repetition penalties,
min_tokens; and the sampler's min_p and greedy rows that were processed."""

from __future__ import annotations

import torch

from kvq.runtime.sampling import SamplingParams, filter_min_p, needs_processing, process_row, sample

ROW = torch.tensor([2.0, -1.0, 0.5, 3.0, -4.0])


def test_plain_requests_are_not_processed() -> None:
    assert not needs_processing(SamplingParams(temperature=0.7, top_k=3, top_p=0.9, min_p=0.1))
    assert needs_processing(SamplingParams(min_tokens=2)) and needs_processing(
        SamplingParams(logit_bias={1: 2})
    )


def test_logit_bias_adds() -> None:
    row = process_row(ROW, SamplingParams(logit_bias={1: 5.0, 4: -100.0}), [], [], {0})
    assert row.tolist() == [2.0, 4.0, 0.5, 3.0, -104.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    row = process_row(ROW, SamplingParams(repetition_penalty=2.0), [0], [1], set())
    assert row.tolist() == [1.0, -2.0, 0.5, 3.0, -4.0]  # prompt and completion tokens alike


def test_presence_and_frequency_count_completion_tokens_only() -> None:
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    row = process_row(ROW, params, [2, 2, 2], [3, 3, 0], set())
    assert row.tolist() == [2.0 - 0.75, -1.0, 0.5, 3.0 - 1.0, -4.0]


def test_min_tokens_holds_back_eos_and_stop_token_ids() -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=[2])
    early = process_row(ROW, params, [], [1], {3})
    assert early[2] == early[3] == float("-inf") and early[0] == 2.0
    assert torch.equal(process_row(ROW, params, [], [1, 1], {3}), ROW)
    ignoring = process_row(ROW, SamplingParams(min_tokens=2, ignore_eos=True), [], [], {3})
    assert ignoring[3] == 3.0


def test_processed_greedy_rows_take_their_argmax() -> None:
    logits = ROW.repeat(2, 1)
    processed = {1: process_row(ROW, SamplingParams(logit_bias={4: 10.0}), [], [], set())}
    tokens, errors = sample(logits, [SamplingParams()] * 2, [None, None], processed)
    assert tokens == [3, 4] and errors == [None, None]


def test_min_p_keeps_tokens_near_the_most_likely() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert torch.equal(filter_min_p(probs, 0.2), torch.tensor([0.5, 0.3, 0.15, 0.0]))
    params = SamplingParams(temperature=1.0, min_p=0.9, seed=0)
    gens = [torch.Generator().manual_seed(s) for s in range(20)]
    drawn = {sample(ROW[None], [params], [g])[0][0] for g in gens}
    assert drawn == {3}  # only the most likely token is within 0.9 of itself here
