"""Decode speed for `kvq bench decode`: tokens/s of generators at one concurrency, and the generators
(kvq engines and transformers `generate`, same chat prompt, greedy, EOS ignored). Imports torch; kvq's
runtime and transformers inside the builders."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

PROMPT = "Tell me about the history of the city of Paris."
Generate = Callable[[int], object]  # generate(n): the contender's requests, n new tokens each


@dataclass(frozen=True)
class FixtureDecodeConfig:
    """What every decode bench on the glm_moe_dsa bench fixture sets (`decode_mla`, `decode_spec`)."""

    threads: int = 2
    repeats: int = 3
    new_tokens: int = 16
    prompt_tokens: int = 96  # > index_topk (64): the indexer selects at every step
    page_size: int = 16


def decode_tok_s(
    contenders: dict[str, Generate], num_seqs: int, new_tokens: int, repeats: int
) -> dict[str, list[float]]:
    """Each contender's decode tokens/s per repeat: num_seqs * (N - 1) / (t(N) - t(1)), so prefill and the
    first token cancel out. Contenders take turns within every repeat (drift on a shared machine hits
    all alike); the caller takes the median. Where a loaded machine makes t(N) - t(1) under a tenth of
    t(N) (short N), the repeat counts num_seqs * N / t(N) instead: prefill included, a lower bound, never a
    negative or absurd speed."""
    runs: dict[str, list[float]] = {name: [] for name in contenders}
    for generate in contenders.values():
        generate(4)  # warm-up
    for _ in range(repeats):
        for name, generate in contenders.items():
            start = time.perf_counter()
            generate(1)
            middle = time.perf_counter()
            generate(new_tokens)
            end = time.perf_counter()
            decode_s = end - middle - (middle - start)
            is_decode_seen = decode_s > 0.1 * (end - middle)  # else noise swamped t(N) - t(1)
            speed = (
                num_seqs * (new_tokens - 1) / decode_s
                if is_decode_seen
                else num_seqs * new_tokens / (end - middle)
            )
            runs[name].append(speed)
    return runs


def kvq_generate(engine, num_seqs: int) -> Generate:
    """`num_seqs` copies of the chat prompt through a kvq `Engine`, decoded together."""
    from kvq.runtime.sampling import SamplingParams

    prompt = engine.encode_chat(PROMPT)
    return lambda n: engine.generate([prompt] * num_seqs, SamplingParams(max_tokens=n, ignore_eos=True))


def transformers_generate(path: Path) -> Generate:
    """transformers' BF16 `generate` of the chat prompt (one request)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    input_ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])

    @torch.inference_mode()
    def generate(n: int) -> object:
        return model.generate(
            input_ids,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )

    return generate
