"""A prompt's own log-probabilities (`SamplingParams.prompt_logprobs`): transformers' log-softmax over the
same prompt in fp32 reference mode; the same whether the prompt's prefix is in the prefix cache or not;
the same in chunks of any size; `max_tokens` 0 scores without generating; through INT4 + FP8 KV too.
"""

from __future__ import annotations

import pytest
import torch

import kvq.runtime.prompt_logprobs as prompt_logprobs
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.outputs import RequestOutput
from kvq.runtime.sampling import SamplingParams
from tests.runtime.reference import hf_logits, hf_reference

PROMPT = torch.randint(3, 2000, (45,), generator=torch.Generator().manual_seed(7)).tolist()  # 2+ pages


def scored(engine: Engine, prompt: list[int], num_top: int = 3, max_tokens: int = 1) -> RequestOutput:
    params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=num_top, ignore_eos=True)
    return engine.generate([prompt], params)[0]


@pytest.fixture(scope="module", params=["llama", "glm_moe_dsa"])
def reference(request, tiny_checkpoint) -> Engine:
    path = tiny_checkpoint(request.param, "bf16")
    return Engine(EngineConfig(model=str(path), dtype="float32", kv_memory="16MiB"))


def test_prompt_logprobs_are_transformers_log_softmax(reference: Engine) -> None:
    out = scored(reference, PROMPT)
    expected = torch.log_softmax(hf_logits(hf_reference(reference.ckpt.root), PROMPT), dim=-1)  # [L, V]
    entries = out.prompt_logprobs
    assert [e.token_id for e in entries] == PROMPT and entries[0].logprob is None and entries[0].rank is None
    found = torch.tensor([e.logprob for e in entries[1:]])
    want = expected[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    torch.testing.assert_close(found, want, atol=2e-4, rtol=0)
    for i, entry in enumerate(entries[1:]):
        top = expected[i].topk(3)
        assert [t.token_id for t in entry.top] == top.indices.tolist()
        assert entry.rank == int((expected[i] > expected[i, entry.token_id]).sum()) + 1
    assert len(out.token_ids) == 1


def test_a_cached_prefix_scores_as_an_uncached_one(reference: Engine) -> None:
    reference.reset_kv()
    fresh = scored(reference, PROMPT + [9, 10])
    reference.generate([PROMPT], SamplingParams(max_tokens=1))  # its full pages are now cached
    hits = reference.block_manager.num_prefix_hits
    again = reference.generate([PROMPT[:40]], SamplingParams(max_tokens=1))[0]  # a plain request hits them
    assert reference.block_manager.num_prefix_hits > hits and again.finish_reason == "length"
    cached = scored(reference, PROMPT + [9, 10])
    assert [(e.token_id, e.logprob, e.rank) for e in cached.prompt_logprobs] == [
        (e.token_id, e.logprob, e.rank) for e in fresh.prompt_logprobs
    ]


def test_chunks_of_any_size_give_the_same_scores(reference: Engine, monkeypatch) -> None:
    whole = scored(reference, PROMPT, num_top=5)
    monkeypatch.setattr(prompt_logprobs, "CHUNK_ELEMENTS", 7 * reference.model.config.vocab_size)
    chunked = scored(reference, PROMPT, num_top=5)
    for a, b in zip(chunked.prompt_logprobs[1:], whole.prompt_logprobs[1:], strict=True):
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]  # a GEMM of other row counts:
        assert abs(a.logprob - b.logprob) < 1e-5  # the same up to fp32 summation order


def test_max_tokens_zero_scores_without_generating(reference: Engine) -> None:
    out = scored(reference, PROMPT, num_top=0, max_tokens=0)
    assert out.token_ids == [] and out.finish_reason == "length" and out.text == ""
    assert len(out.prompt_logprobs) == len(PROMPT) and all(not e.top for e in out.prompt_logprobs)
    assert reference.block_manager.num_free_pages == reference.kv_pool.num_pages


def test_int4_with_fp8_pages_scores_close_to_bf16(int4_checkpoint, tiny_checkpoint) -> None:
    """The fast path (INT4 weights, bf16 activations, FP8 pages without scales: 1.0) stays near fp32."""
    fast = Engine(
        EngineConfig(model=str(int4_checkpoint("llama")), kv_cache_dtype="fp8_e4m3", kv_memory="16MiB")
    )
    exact = Engine(
        EngineConfig(model=str(tiny_checkpoint("llama", "bf16")), dtype="float32", kv_memory="16MiB")
    )
    found = torch.tensor([e.logprob for e in scored(fast, PROMPT).prompt_logprobs[1:]])
    want = torch.tensor([e.logprob for e in scored(exact, PROMPT).prompt_logprobs[1:]])
    assert (found - want).abs().mean() < 0.05 * want.abs().mean()
