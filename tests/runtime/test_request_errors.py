"""A failure in one request's own output handling (a token hook, its text, its sampling) ends that request
alone with finish reason "error" and a message naming what failed; the rest of the step goes on and the
engine keeps serving."""

from __future__ import annotations

import pytest

from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.sampling import SamplingParams
from tests.runtime.reference import engine_greedy

PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> Engine:
    path = tiny_checkpoint("llama", "bf16")
    return Engine(EngineConfig(model=str(path), dtype="float32", kv_memory="16MiB"))


def failing_on(prompt: list[int], after: int):
    """A token hook that raises for the request with `prompt` once it has `after` completion tokens."""

    def hook(seqs, logits, token_ids) -> None:
        for seq in seqs:
            if seq.token_ids[: seq.num_prompt_tokens] == prompt and len(seq.completion_token_ids) >= after:
                raise ValueError("injected fault")

    return hook


def test_a_failing_token_hook_ends_only_its_request(engine: Engine) -> None:
    expected = engine_greedy(engine, PROMPTS, 8)
    engine.token_hooks.append(failing_on(PROMPTS[1], 3))
    try:
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    finally:
        engine.token_hooks.pop()
    hit = outs[1]
    assert hit.finish_reason == "error" and "output handling failed (ValueError: injected fault)" in hit.error
    assert hit.token_ids == expected[1][:3]
    assert [outs[0].token_ids, outs[2].token_ids] == [expected[0], expected[2]]
    assert engine.block_manager.num_free_pages == engine.kv_pool.num_pages
    assert engine_greedy(engine, PROMPTS, 8) == expected  # and the next requests are served


def test_a_failing_text_ends_only_its_request(engine: Engine, monkeypatch) -> None:
    expected = engine_greedy(engine, PROMPTS, 6)
    add = engine.outputs.add

    def fragile_add(seq) -> None:
        add(seq)
        if seq.params.seed == 99:  # the request under test: its text fails at its third token
            text = engine.outputs.texts[seq.seq_id]
            real, calls = text.add, iter(range(100))
            text.add = lambda *a, **k: real(*a, **k) if next(calls) < 2 else 1 / 0  # type: ignore[method-assign]

    monkeypatch.setattr(engine.outputs, "add", fragile_add)
    params = [SamplingParams(max_tokens=6, ignore_eos=True, seed=s) for s in (1, 99, 2)]
    outs = engine.generate(PROMPTS, params)
    assert outs[1].finish_reason == "error" and "ZeroDivisionError" in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == [expected[0], expected[2]]
    assert engine.block_manager.num_free_pages == engine.kv_pool.num_pages
