"""The official `openai` client on what harnesses read from `kvq serve`: the prompt's log-probabilities
(`echo` with `logprobs`, `max_tokens` 0 and 1 as lm-eval sends them, and vLLM's `prompt_logprobs`),
equal to transformers' fp32 forward of the same ids, also when the prompt's prefix is cached; and a
client that leaves mid-stream, after which the engine holds nothing of it and the next request succeeds.
(Streaming, `n` > 1, sampled-token logprobs and stop strings: tests/serve/test_openai_api.py.)
"""

from __future__ import annotations

import re
import time

import httpx
import pytest
import torch

from tests.serve.conftest import Running

openai = pytest.importorskip("openai")

PROMPT = "The capital of France is Paris, and the capital of Italy is Rome. The capital of Spain is"
ATOL = 1e-4  # fp32 sums in another order than transformers'


@pytest.fixture(scope="module")
def client(fp32_server: Running):
    return openai.OpenAI(base_url=f"{fp32_server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def hf_model(smollm2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2.bf16, dtype=torch.float32).eval()


def hf_log_probs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log_softmax of transformers' fp32 logits; row i predicts token i + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1)


def prefix_cache_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(r"^kvq:prefix_cache_hits_total (\S+)$", text, re.M).group(1))


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt(
    fp32_server: Running, client, hf_model, max_tokens: int
) -> None:
    ids = fp32_server.served.encoder.tokenizer.encode(PROMPT)
    expected = hf_log_probs(hf_model, ids)
    reply = client.completions.create(
        model="smollm2", prompt=PROMPT, echo=True, logprobs=2, max_tokens=max_tokens, temperature=0
    )
    choice, tokenizer = reply.choices[0], fp32_server.served.encoder.tokenizer
    lp = choice.logprobs
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == max_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + max_tokens
    assert lp.tokens[: len(ids)] == [tokenizer.decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    for position in range(1, len(ids)):
        row = expected[position - 1]
        assert lp.token_logprobs[position] == pytest.approx(float(row[ids[position]]), abs=ATOL)
        top = row.topk(2)
        for token_id, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert lp.top_logprobs[position][tokenizer.decode([token_id])] == pytest.approx(value, abs=ATOL)
    assert lp.text_offset[: len(ids)] == [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]
    if max_tokens:  # the greedy completion token, scored from the prompt's last row
        greedy = int(expected[-1].argmax())
        assert choice.text == PROMPT + tokenizer.decode([greedy])
        assert lp.token_logprobs[-1] == pytest.approx(float(expected[-1][greedy]), abs=ATOL)
    else:
        assert choice.text == PROMPT


def test_prompt_logprobs_extension_equals_echo(client) -> None:
    echoed = client.completions.create(
        model="smollm2", prompt=PROMPT, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    vllm_style = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    entries = vllm_style.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None
    echoed_values = echoed.choices[0].logprobs.token_logprobs[1:-1]
    assert len(entries) - 1 == len(echoed_values)
    for entry, value in zip(entries[1:], echoed_values, strict=True):
        # vLLM's form: {token id: {logprob, rank, decoded_token}}, the prompt's own token among them
        assert value in [e["logprob"] for e in entry.values()]


def test_a_cached_prefix_gives_the_same_prompt_logprobs(fp32_server: Running, client) -> None:
    def scored(prompt: str) -> list[float | None]:
        reply = client.completions.create(
            model="smollm2", prompt=prompt, echo=True, logprobs=0, max_tokens=0, temperature=0
        )
        return reply.choices[0].logprobs.token_logprobs

    longer = PROMPT + " Madrid, and the capital of Portugal is Lisbon."
    uncached = scored(longer)
    for _ in range(2):  # the first caches the prompt's full pages, the second finds them
        hits_before = prefix_cache_hits(fp32_server.url)
        client.completions.create(model="smollm2", prompt=longer, max_tokens=1, temperature=0)
    assert prefix_cache_hits(fp32_server.url) - hits_before >= 16  # a page of `longer` is cached
    assert scored(longer) == pytest.approx(uncached, abs=1e-5)


def test_client_leaving_mid_stream(fp32_server: Running, client) -> None:
    stream = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
        max_tokens=400,
        temperature=0.8,
        seed=1,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    stream.close()
    deadline = time.monotonic() + 60
    while fp32_server.async_engine.num_running or fp32_server.async_engine.num_waiting:
        assert time.monotonic() < deadline, "the engine still runs the request of a client that left"
        time.sleep(0.05)
    manager = fp32_server.engine.block_manager
    assert manager.num_free_pages == manager.num_pages  # its KV pages came back
    reply = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=3, temperature=0
    )
    assert reply.choices[0].text == " Paris.\n" and reply.choices[0].finish_reason == "length"
