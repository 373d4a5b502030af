"""The engine end to end on the tiny fixtures: prefix sharing and forced preemption leave greedy outputs
unchanged; stop conditions, streaming, seeds; bad input is a user error; a non-finite row ends only its
own request."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvq.errors import KvqError
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.kv_pool import page_bytes
from kvq.runtime.sampling import SamplingParams
from tests.runtime.reference import engine_greedy, hf_greedy, hf_reference

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def shared_prefix_prompts(num: int = 6, prefix_len: int = 22, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 2000, (prefix_len,), generator=gen).tolist()
    return [prefix + torch.randint(3, 2000, (3 + i,), generator=gen).tolist() for i in range(num)]


def engine_with_pages(path: Path, num_pages: int, page_size: int = 4, **kwargs) -> Engine:
    """A reference-mode engine whose pool holds exactly `num_pages` pages."""
    probe = Engine(EngineConfig(model=str(path), dtype="float32", kv_memory="1MiB", page_size=page_size))
    is_checked = kwargs.get("kv_integrity", "off") != "off"  # a checked pool's pages hold slot stamps too
    size = page_bytes(probe.kv_pool.layout, probe.kv_pool.num_layers, page_size, is_checked)
    engine = Engine(
        EngineConfig(
            model=str(path), dtype="float32", kv_memory=num_pages * size, page_size=page_size, **kwargs
        )
    )
    assert engine.kv_pool.num_pages == num_pages
    return engine


@pytest.mark.parametrize("arch", ["llama", "glm4_moe"])
def test_prefix_sharing_and_preemption_leave_outputs_unchanged(tiny_checkpoint, arch: str) -> None:
    path = tiny_checkpoint(arch, "bf16")
    prompts = shared_prefix_prompts()
    hf = hf_reference(path)
    expected = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    roomy = Engine(
        EngineConfig(model=str(path), dtype="float32", kv_memory="16MiB", enable_prefix_caching=False)
    )
    assert engine_greedy(roomy, prompts, GREEDY.max_tokens) == expected
    # 30 pages of 4 tokens for six requests of up to 55 tokens (14 pages each): admitted on prompt pages
    # alone, they run out of pages in decode and are preempted and recomputed, sharing the prefix pages
    tight = engine_with_pages(path, 30, decode_reserve_ratio=0.0)
    assert engine_greedy(tight, prompts, GREEDY.max_tokens) == expected
    assert tight.scheduler.num_preemptions > 0
    assert tight.block_manager.num_prefix_hits >= 5 * 5  # five later prompts share five full prefix pages
    assert tight.block_manager.num_free_pages == 30  # every page came back


def test_checked_pages_change_no_token_under_sharing_and_preemption(tiny_checkpoint) -> None:
    """--kv-integrity tags / full on the tight pool above: the same greedy tokens as off, nothing stopped."""
    path = tiny_checkpoint("llama", "bf16")
    prompts = shared_prefix_prompts()
    off = engine_with_pages(path, 30, decode_reserve_ratio=0.0, threads=1)
    expected = engine_greedy(off, prompts, GREEDY.max_tokens)
    for mode in ("tags", "full"):
        engine = engine_with_pages(path, 30, decode_reserve_ratio=0.0, threads=1, kv_integrity=mode)
        assert engine_greedy(engine, prompts, GREEDY.max_tokens) == expected
        assert engine.stats.integrity_aborts == 0 and engine.scheduler.num_preemptions > 0
        assert engine.block_manager.num_prefix_hits >= 5 * 5 and engine.block_manager.num_free_pages == 30


def test_stop_strings_stop_tokens_and_max_tokens(tiny_checkpoint) -> None:
    engine = Engine(
        EngineConfig(model=str(tiny_checkpoint("llama", "bf16")), dtype="float32", kv_memory="16MiB")
    )
    prompt = engine.tokenizer.encode("the quick brown fox")
    free = engine.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    stop_token = free.token_ids[5]
    by_token = engine.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=[stop_token]))[0]
    assert (
        by_token.finish_reason == "stop"
        and by_token.token_ids == free.token_ids[: free.token_ids.index(stop_token) + 1]
    )
    stop = free.text[len(free.text) // 2 :][:3]
    by_text = engine.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop]))[0]
    assert by_text.finish_reason == "stop" and by_text.text == free.text[: free.text.index(stop)]


def test_streamed_deltas_add_up_to_the_text(tiny_checkpoint) -> None:
    engine = Engine(EngineConfig(model=str(tiny_checkpoint("llama", "bf16")), kv_memory="16MiB"))
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=3, stop=["zz"])
    outputs = list(engine.stream(engine.encode_chat("hello there"), params))
    assert outputs[-1].finished and sum(not o.finished for o in outputs) == len(outputs) - 1
    assert "".join(o.delta for o in outputs) == outputs[-1].text
    again = list(engine.stream(engine.encode_chat("hello there"), params))
    assert again[-1].token_ids == outputs[-1].token_ids  # same seed, same tokens


def test_non_finite_logits_end_only_that_request(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(
        EngineConfig(model=str(tiny_checkpoint("llama", "bf16")), dtype="float32", kv_memory="16MiB")
    )
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    expected = engine_greedy(engine, prompts, 8)
    run = engine.runner.run

    def poisoned(seqs, is_prefill):
        out = run(seqs, is_prefill)
        logits = out.logits.clone()
        for row, seq in enumerate(seqs):
            if seq.token_ids[: seq.num_prompt_tokens] == prompts[0] and seq.num_tokens > 5:
                logits[row, 0] = float("nan")
        return replace(out, logits=logits)

    monkeypatch.setattr(engine.runner, "run", poisoned)
    bad, good = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert (
        bad.finish_reason == "error" and "non-finite logits" in bad.error and bad.token_ids == expected[0][:3]
    )
    assert good.finish_reason == "length" and good.token_ids == expected[1]
    assert engine.block_manager.num_free_pages == engine.kv_pool.num_pages


def test_bad_requests_are_user_errors(tiny_checkpoint) -> None:
    engine = Engine(
        EngineConfig(model=str(tiny_checkpoint("llama", "bf16")), kv_memory="1MiB", max_model_len=64)
    )
    with pytest.raises(KvqError, match="prompt has 64 tokens but the context holds 64"):
        engine.generate([[5] * 64], SamplingParams())
    with pytest.raises(KvqError, match="max_tokens must be >= 0"):
        engine.generate([[5]], SamplingParams(max_tokens=-1))
    with pytest.raises(KvqError, match="logit_bias and stop_token_ids take token ids in the vocabulary"):
        engine.generate([[5]], SamplingParams(logit_bias={99999: 1.0}))
    with pytest.raises(KvqError, match="empty"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(KvqError, match="outside the vocabulary"):
        engine.generate([[5, 99999]], SamplingParams())
    with pytest.raises(KvqError, match="--max-model-len 100000 exceeds"):
        Engine(EngineConfig(model=str(tiny_checkpoint("llama", "bf16")), max_model_len=100000))
    assert not engine.has_unfinished_requests()  # nothing was queued by a rejected batch


def test_a_request_larger_than_the_pool_is_refused(tiny_checkpoint) -> None:
    engine = engine_with_pages(tiny_checkpoint("llama", "bf16"), 4)
    with pytest.raises(KvqError, match="needs 5 KV pages but the pool has 4"):
        engine.generate([[5] * 10], SamplingParams(max_tokens=10))


def test_many_requests_on_a_small_pool_all_finish(tiny_checkpoint) -> None:
    engine = engine_with_pages(tiny_checkpoint("glm4_moe", "bf16"), 12, page_size=8, max_num_seqs=4)
    prompts = [[3 + i] * (4 + i) for i in range(20)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in outs)
    assert engine.block_manager.num_free_pages == 12


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8_e4m3"])
def test_stale_or_garbage_slots_are_never_read(tiny_checkpoint, kv_cache_dtype: str) -> None:
    path = tiny_checkpoint("llama", "bf16")
    engine = Engine(
        EngineConfig(
            model=str(path),
            kv_cache_dtype=kv_cache_dtype,
            kv_memory="1MiB",
            page_size=8,
            enable_prefix_caching=False,
        )
    )  # NaN-filling the pool corrupts cached pages too
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
    expected = engine_greedy(engine, prompts, 6)
    for cache in (*(c.k_cache for c in engine.kv_pool.caches), *(c.v_cache for c in engine.kv_pool.caches)):
        cache[: engine.kv_pool.num_pages].fill_(float("nan"))  # all but the zero page: any leftover
    assert engine_greedy(engine, prompts, 6) == expected
