"""Oracles for the runtime tests: transformers' fp32 forward of a checkpoint's dequantized weights, and
teacher-forced logits of a kvq engine (prefill, then one forced token per decode step)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.initialization import no_init_weights

from kvq.checkpoint.dense import read_dense
from kvq.checkpoint.expert_layout import fuse_experts
from kvq.checkpoint.model_config import load_text_config
from kvq.checkpoint.reader import Checkpoint
from kvq.runtime.engine import Engine
from kvq.runtime.sampling import SamplingParams


def hf_reference(path: Path) -> PreTrainedModel:
    """transformers' model of `path`'s language model (Kimi: DeepseekV3 of `text_config`) in fp32 holding
    `read_dense` of its (possibly quantized) weights."""
    config, prefix = load_text_config(path)
    with no_init_weights():  # every weight is loaded below: skip the random init (~3 s on SmolLM2)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.tie_weights()  # which post_init's skipped init_weights would have done
    dense = read_dense(Checkpoint.open(path), prefix, torch.float32)
    state = fuse_experts({k.removeprefix(prefix): v for k, v in dense.items()})
    state = {k: v for k, v in state.items() if not k.endswith(("k_scale", "v_scale"))}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("inv_freq" in k or k == "lm_head.weight" for k in missing), (
        missing,
        unexpected,
    )
    return model


@torch.inference_mode()
def hf_greedy(model: PreTrainedModel, prompt: list[int], num_tokens: int) -> list[int]:
    """`num_tokens` greedy tokens from transformers' forward with its KV cache (EOS not special)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    for _ in range(num_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@torch.inference_mode()
def hf_stepped_logits(model: PreTrainedModel, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """fp32 logits `[len(forced) + 1, V]` as transformers' generate makes them: a prefill of the prompt,
    then one cached decode step per forced token (GLM-5's indexer scores a decode query in a row of its
    own context, not in the prefill's padded one, which may break an exact tie the other way)."""
    out = model(torch.tensor([prompt]), use_cache=True)
    rows = [out.logits[0, -1].float()]
    for token in forced:
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
        rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


@torch.inference_mode()
def hf_logits(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits `[L, V]` at every position of `token_ids`."""
    return model(torch.tensor([token_ids])).logits[0].float()


@torch.inference_mode()
def hf_last_logits(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits `[V]` after the last token of `token_ids` (`logits_to_keep=1`: the same forward, with
    the lm_head on the last row alone)."""
    return model(torch.tensor([token_ids]), logits_to_keep=1).logits[0, -1].float()


def engine_greedy(engine: Engine, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    outs = engine.generate(prompts, SamplingParams(max_tokens=num_tokens, ignore_eos=True))
    return [o.token_ids for o in outs]


def teacher_forced_logits(engine: Engine, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """fp32 logits `[len(forced) + 1, V]` on the CPU: after the prompt, then after each forced token (decode
    steps)."""
    seq = engine.make_sequence(prompt, SamplingParams(max_tokens=len(forced) + 1))
    engine.block_manager.allocate(seq)
    rows = [engine.runner.run([seq], is_prefill=True).logits[0]]
    for token in forced:
        seq.token_ids.append(token)
        assert engine.block_manager.can_append(seq)
        engine.block_manager.may_append(seq)
        rows.append(engine.runner.run([seq], is_prefill=False).logits[0])
    engine.block_manager.deallocate(seq)
    return torch.stack(rows).cpu()


def batch_teacher_forced_logits(
    engine: Engine, prompts: list[list[int]], forced: list[list[int]]
) -> torch.Tensor:
    """fp32 logits `[steps, B, V]`: the prompts' prefill, then decode steps of the whole batch with the
    forced tokens appended (`teacher_forced_logits` for a batch)."""
    seqs = [engine.make_sequence(p, SamplingParams(max_tokens=len(forced[0]) + 1)) for p in prompts]
    for seq in seqs:
        engine.block_manager.allocate(seq)
    steps = [torch.stack([engine.runner.run([seq], is_prefill=True).logits[0] for seq in seqs])]
    for t in range(len(forced[0])):
        for seq, tokens in zip(seqs, forced, strict=True):
            seq.token_ids.append(tokens[t])
            engine.block_manager.may_append(seq)
        steps.append(engine.runner.run(seqs, is_prefill=False).logits)
    for seq in seqs:
        engine.block_manager.deallocate(seq)
    return torch.stack(steps).float().cpu()
