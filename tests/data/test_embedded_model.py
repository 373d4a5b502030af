"""The embedded SmolLM2-135M-Instruct: built once from the GGUF, answers a chat prompt, FP8 twin agrees."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvq.checkpoint.reader import Checkpoint
from kvq.data.embedded_model import ensure_smollm2
from kvq.formats.fp8_block import dequantize_fp8_block

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _greedy_answer(model, tokenizer) -> str:
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"]  # [1, S]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_second_call_reuses_the_cache(smollm2):
    index = smollm2.fp8 / "model.safetensors.index.json"
    before = index.stat().st_mtime_ns
    assert ensure_smollm2(smollm2.bf16.parent.parent) == smollm2
    assert index.stat().st_mtime_ns == before


def test_bf16_smollm2_answers_a_chat_prompt(smollm2):
    assert Checkpoint.open(smollm2.bf16).format == "bf16"
    model, info = AutoModelForCausalLM.from_pretrained(smollm2.bf16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.bfloat16 and model.config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(smollm2.bf16)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    assert "Paris" in _greedy_answer(model, tokenizer)


def test_fp8_smollm2_dequantizes_to_nearly_the_bf16_model(smollm2):
    # transformers 5.17 cannot load it itself: hidden 576 leaves partial 128x128 blocks.
    ckpt = Checkpoint.open(smollm2.fp8)
    assert ckpt.format == "fp8-block" and len(ckpt.shards) >= 3
    tensors = ckpt.read_many(ckpt.tensors)
    reference = AutoModelForCausalLM.from_pretrained(smollm2.bf16)
    model = AutoModelForCausalLM.from_pretrained(smollm2.bf16)
    state = {}
    for name, tensor in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            tensor = dequantize_fp8_block(tensor, tensors[f"{name}_scale_inv"], dtype=torch.bfloat16)
        state[name] = tensor
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to embed_tokens
    tokenizer = AutoTokenizer.from_pretrained(smollm2.fp8)
    answer = "The capital of France is Paris, a city on the Seine."
    chat = QUESTION + [{"role": "assistant", "content": answer}]
    ids = tokenizer.apply_chat_template(chat, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = reference(ids).logits.float().log_softmax(-1)  # [1, S, V]
        got = model(ids).logits.float().log_softmax(-1)
    kl = (ref.exp() * (ref - got)).sum(-1).mean()
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean()
    # Measured: KL 0.045 nats/token. Greedy decoding is NOT compared: the first answer token is a
    # near tie ("The" vs "L'") that FP8 flips, after which the two answers differ entirely.
    assert 0 < kl < 0.1 and top1 >= 0.8
