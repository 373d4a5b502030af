"""The OpenAI surface of `kvq serve`, spoken by the official `openai` client to a real server on loopback.

Answers are checked against the engine run directly on the same weights (fp32 reference mode, greedy or
seeded): text, `usage` equal to the token counts, log-probabilities equal to log_softmax of the logits
the engine sampled from (captured by a token hook of the test's own; within 1e-4, as fp32 sums differ
with the batch), n > 1 (choice i seeded seed + i), stop strings, echo, `stream_options.include_usage`.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch

import kvq
from kvq.runtime.engine import Engine
from kvq.runtime.sampling import SamplingParams
from tests.serve.conftest import Running, running_server

openai = pytest.importorskip("openai")

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def server(smollm2_engine: Engine) -> Iterator[Running]:
    with running_server(smollm2_engine) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Running):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def on_engine(server: Running, fn):
    """`fn(engine)` on the engine thread between steps (the server owns the engine)."""
    return server.async_engine.call(fn).result(timeout=300)


def engine_run(server: Running, token_ids: list[int], params: SamplingParams) -> tuple[list[int], str, list]:
    """(token ids, text, each step's fp32 logits row) of one request run alone on the engine."""
    rows: list[torch.Tensor] = []

    def run(engine: Engine):
        def capture(seqs, logits, token_ids) -> None:
            rows.append(logits[0].double().clone())

        engine.token_hooks.append(capture)
        try:
            out = engine.generate([token_ids], params)[0]
        finally:
            engine.token_hooks.remove(capture)
        return out.token_ids, out.text

    ids, text = on_engine(server, run)
    return ids, text, rows


def test_completion_text_usage_and_logprobs(server: Running, client) -> None:
    prompt_ids = on_engine(server, lambda e: e.encode(PROMPT))
    ids, text, rows = engine_run(server, prompt_ids, SamplingParams(max_tokens=MAX_TOKENS))
    reply = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=3
    )
    choice = reply.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), len(ids))
    assert reply.usage.total_tokens == len(prompt_ids) + len(ids)
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(ids) == len(rows)
    tokenizer = server.served.encoder.tokenizer
    for step, (token_id, row) in enumerate(zip(ids, rows, strict=True)):
        log_probs = torch.log_softmax(row, -1)
        assert lp.tokens[step] == tokenizer.decode([token_id])
        assert lp.token_logprobs[step] == pytest.approx(float(log_probs[token_id]), abs=1e-4)
        top = log_probs.topk(3)
        expected = {
            tokenizer.decode([t]): v for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
        }
        assert set(lp.top_logprobs[step]) >= set(expected)
        for token, value in expected.items():
            assert lp.top_logprobs[step][token] == pytest.approx(value, abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_chat_streamed_with_usage_and_logprobs(server: Running, client) -> None:
    prompt_ids = on_engine(server, lambda e: e.encode_messages(CHAT))
    ids, text, rows = engine_run(server, prompt_ids, SamplingParams(max_tokens=MAX_TOKENS))
    stream = client.chat.completions.create(
        model="smollm2",
        messages=CHAT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(prompt_ids), len(ids))
    entries = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == len(ids)
    for entry, token_id, row in zip(entries, ids, rows, strict=True):
        log_probs = torch.log_softmax(row, -1)
        assert entry.logprob == pytest.approx(float(log_probs[token_id]), abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            log_probs.topk(2).values.tolist(), abs=1e-4
        )
        assert bytes(entry.bytes).decode(errors="replace") == entry.token


def test_chat_plain_has_usage(server: Running, client) -> None:
    prompt_ids = on_engine(server, lambda e: e.encode_messages(CHAT))
    ids, text, _ = engine_run(server, prompt_ids, SamplingParams(max_tokens=MAX_TOKENS))
    reply = client.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert reply.choices[0].message.content == text and reply.choices[0].logprobs is None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), len(ids))


def test_n_choices_are_seeded_seed_plus_index(server: Running, client) -> None:
    prompt_ids = on_engine(server, lambda e: e.encode(PROMPT))
    runs = [
        engine_run(server, prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=7 + i))
        for i in range(3)
    ]
    expected = [text for _, text, _ in runs]
    reply = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.9, seed=7, n=3
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == expected and len(set(expected)) > 1
    assert reply.usage.prompt_tokens == len(prompt_ids)  # once: the choices share the prompt
    assert reply.usage.completion_tokens == sum(len(ids) for ids, _, _ in runs)
    stream = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.9, seed=7, n=3, stream=True
    )
    texts = ["", "", ""]
    for chunk in stream:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == expected


def test_stop_strings_seed_and_echo(server: Running, client) -> None:
    prompt_ids = on_engine(server, lambda e: e.encode(PROMPT))
    _, text, _ = engine_run(server, prompt_ids, SamplingParams(max_tokens=MAX_TOKENS))
    word = text.split()[1]  # a word inside the greedy completion
    for stop in (word, ["no such string", word]):
        reply = client.completions.create(
            model="smollm2", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=stop
        )
        assert reply.choices[0].text == text[: text.index(word)] and reply.choices[0].finish_reason == "stop"
    echoed = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + text
    by_ids = client.completions.create(
        model="smollm2", prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0, echo=True
    )
    assert by_ids.choices[0].text == on_engine(server, lambda e: e.tokenizer.decode(prompt_ids)) + text
    seeded = [
        client.completions.create(
            model="smollm2", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, seed=3
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


def test_models_and_batch_prompts(server: Running, client) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["smollm2"]
    assert models[0].model_extra["max_model_len"] == server.engine.max_model_len == 8192
    assert models[0].model_extra["root"] == str(server.engine.ckpt.root)  # vLLM's field: what is served
    assert httpx.get(f"{server.url}/version").json() == {"version": kvq.__version__}
    reply = client.completions.create(
        model="smollm2", prompt=[PROMPT, "Water boils at"], max_tokens=4, temperature=0
    )
    assert [c.index for c in reply.choices] == [0, 1]
    counts = [len(on_engine(server, lambda e, p=p: e.encode(p))) for p in (PROMPT, "Water boils at")]
    assert reply.usage.prompt_tokens == sum(counts) and reply.usage.completion_tokens == 8
