"""`kvq serve` on a checkpoint whose embedding is padded past its tokenizer, sampling at temperature 1 with
seeds that reach ids the tokenizer lacks: every answer is a 200, streamed or not, with logprobs, echo and
stop strings; the ids' text is empty."""

from __future__ import annotations

import json

import httpx
import pytest

from kvq.fixtures.tiny_tokenizer import VOCAB_SIZE
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.sampling import SamplingParams
from tests.serve.conftest import running_server

PADDED = 2560


@pytest.mark.parametrize("arch", ["llama", "glm_moe_dsa"])
def test_every_request_that_samples_unknown_ids_gets_a_200(tiny_checkpoint, arch: str) -> None:
    path = tiny_checkpoint(arch, "bf16", vocab_size=PADDED)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", kv_memory="16MiB", threads=2))
    prompt = [5, 6, 7]
    seeds = range(6)
    sampled = engine.generate(
        [prompt] * 6, [SamplingParams(temperature=1.0, seed=s, max_tokens=12) for s in seeds]
    )
    assert sum(any(t >= VOCAB_SIZE for t in o.token_ids) for o in sampled) >= 3  # the case under test
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "logprobs": 2, "stop": ["zq"]}
    with running_server(engine, "padded") as server:
        for seed, expected in zip(seeds, sampled, strict=True):
            reply = httpx.post(f"{server.url}/v1/completions", json={**body, "seed": seed}, timeout=60)
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            assert choice["text"] == expected.text and choice["finish_reason"] in ("length", "stop")
            unknown = [
                t
                for t, i in zip(choice["logprobs"]["tokens"], expected.token_ids, strict=False)
                if i >= VOCAB_SIZE
            ]
            assert all(t == "" for t in unknown)
            with httpx.stream(
                "POST",
                f"{server.url}/v1/completions",
                json={**body, "seed": seed, "stream": True},
                timeout=60,
            ) as stream:
                assert stream.status_code == 200
                data = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
            text = "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1])
            assert data[-1] == "[DONE]" and text == expected.text
        echo = {
            "prompt": sampled[0].token_ids,
            "max_tokens": 1,
            "echo": True,
            "logprobs": 1,
            "temperature": 0,
        }
        reply = httpx.post(f"{server.url}/v1/completions", json=echo, timeout=60)
        assert (
            reply.status_code == 200 and reply.json()["choices"][0]["logprobs"]["token_logprobs"][0] is None
        )
