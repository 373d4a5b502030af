"""The runtime on real weights: SmolLM2-135M-Instruct (llama, tied embeddings, 9 heads / 3 KV heads),
as BF16, FP8-block and INT4 (W4A16, group 64; kvq's output and llm-compressor's own), against
transformers' fp32 forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.kernels.cpu.w4a8 import NativeW4A8, NativeW8A8, w4a8_path
from kvq.runtime.layers.linear import Int4Linear, Int8Linear
from kvq.runtime.sampling import SamplingParams
from tests.runtime.reference import engine_greedy, hf_greedy, hf_logits, hf_reference, teacher_forced_logits

pytestmark = pytest.mark.slow
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
]
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def chat_prompts(smollm2) -> list[list[int]]:
    engine = Engine(EngineConfig(model=str(smollm2.bf16), kv_memory="8MiB"))
    return [engine.encode_chat(q) for q in QUESTIONS]  # all share the template's system prompt


@pytest.mark.parametrize("which", ["bf16", "int4"])
def test_reference_mode_greedy_matches_transformers(smollm2, smollm2_int4, chat_prompts, which: str) -> None:
    path = smollm2.bf16 if which == "bf16" else smollm2_int4
    hf = hf_reference(path)
    expected = [hf_greedy(hf, p, NUM_TOKENS) for p in chat_prompts]
    engine = Engine(EngineConfig(model=str(path), dtype="float32", kv_memory="64MiB", threads=2))
    assert engine_greedy(engine, chat_prompts, NUM_TOKENS) == expected
    # again on a pool too small for all four: shared system-prompt pages, preemption, recompute
    tight = Engine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            kv_memory="9MiB",
            page_size=8,
            decode_reserve_ratio=0.0,
            threads=2,
        )
    )
    assert engine_greedy(tight, chat_prompts, NUM_TOKENS) == expected
    assert tight.scheduler.num_preemptions > 0 and tight.block_manager.num_prefix_hits > 0


def test_int4_fast_path_with_calibrated_fp8_kv_agrees_with_transformers(
    smollm2_int4_calibrated, chat_prompts
) -> None:
    hf = hf_reference(smollm2_int4_calibrated)
    engine = Engine(
        EngineConfig(model=str(smollm2_int4_calibrated), kv_memory="64MiB", require_kv_scales=True, threads=2)
    )
    assert engine.kv_pool.dtype == torch.float8_e4m3fn
    agreements = []
    for prompt in chat_prompts[:2]:
        continuation = hf_greedy(hf, prompt, NUM_TOKENS)
        expected = hf_logits(hf, prompt + continuation)[len(prompt) - 1 :]
        found = teacher_forced_logits(engine, prompt, continuation)
        picks = found.argmax(-1)
        agreements.append((picks == expected.argmax(-1)).float().mean())
        # a disagreement must be a near-tie in transformers' own logits (bf16 logits step by 0.125 at this
        # size; on an AVX-512 BF16 CPU both sides' bf16 matmuls round differently: measured gaps <= 0.56)
        picked = expected.gather(-1, picks[:, None])[:, 0]
        assert (expected.amax(-1) - picked).max() < 1.0, expected.amax(-1) - picked
        kl = F.kl_div(found.log_softmax(-1), expected.log_softmax(-1), log_target=True, reduction="none").sum(
            -1
        )
        assert kl.median() < 0.05, kl  # measured ~0.01 with FP8 pages, ~0.001 with BF16 pages
    assert torch.stack(agreements).mean() >= 0.85  # >= 0.9 on the AVX2 box; 0.89 on an AVX-512 BF16 CPU
    text = engine.generate([chat_prompts[0]], SamplingParams(max_tokens=12))[0].text
    assert "Paris" in text


@pytest.mark.parametrize("which", ["bf16", "fp8", "int4"])
def test_resident_weights_match_the_checkpoint(smollm2, smollm2_int4, which: str) -> None:
    path = {"bf16": smollm2.bf16, "fp8": smollm2.fp8, "int4": smollm2_int4}[which]
    engine = Engine(EngineConfig(model=str(path), kv_memory="8MiB", lm_head_weights="stored"))
    assert abs(engine.weight_bytes / engine.ckpt.tensor_bytes - 1) < 0.10


@pytest.fixture(scope="module", params=["model_free_ptq", "oneshot"])
def smollm2_llmcompressor_int4(request, smollm2, tmp_path_factory: pytest.TempPathFactory):
    """llm-compressor's own W4A16 output of SmolLM2 (every Linear but lm_head, group 64): files kvq did
    not write, with llm-compressor's config; `model_free_ptq` keeps the shards, `oneshot` (through
    transformers and compressed-tensors' compressor) writes one file without an index."""
    out = tmp_path_factory.mktemp(f"smollm2-{request.param}") / "model"
    if request.param == "model_free_ptq":
        from kvq.bench.compress import run_model_free_ptq

        run_model_free_ptq(str(smollm2.bf16), str(out), "w4a16-linear", 2, group_size=64)
        return out
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvq.compress.recipe import load_recipe

    model = AutoModelForCausalLM.from_pretrained(smollm2.bf16, dtype=torch.bfloat16)
    config = load_recipe("w4a16-linear", 64).quantization_config()
    oneshot(
        model=model, recipe=QuantizationModifier(config_groups=config.config_groups, ignore=config.ignore)
    )
    model.save_pretrained(out, save_compressed=True)
    AutoTokenizer.from_pretrained(smollm2.bf16).save_pretrained(out)
    return out


def test_llm_compressor_output_runs_packed_and_matches_transformers(
    smollm2_llmcompressor_int4, chat_prompts
) -> None:
    path = smollm2_llmcompressor_int4
    assert not (path / "kvq_manifest.json").exists()
    hf = hf_reference(path)
    expected = [hf_greedy(hf, p, NUM_TOKENS) for p in chat_prompts[:2]]
    engine = Engine(EngineConfig(model=str(path), dtype="float32", kv_memory="64MiB", threads=2))
    assert engine_greedy(engine, chat_prompts[:2], NUM_TOKENS) == expected
    fast = Engine(EngineConfig(model=str(path), kv_memory="8MiB", lm_head_weights="stored"))  # INT4 packed
    assert abs(fast.weight_bytes / fast.ckpt.tensor_bytes - 1) < 0.10
    assert "Paris" in fast.generate([chat_prompts[0]], SamplingParams(max_tokens=12))[0].text


@pytest.mark.skipif(w4a8_path() is None, reason="int4_compute w4a8 needs AVX2 and kvq's CPU extension")
def test_int4_compute_w4a8_agrees_with_transformers_and_holds_the_same_bytes(
    smollm2_int4, chat_prompts
) -> None:
    """The opt-in W4A8 mode on real weights: every INT4 Linear on the W4A8 kernel (its own layout, the same
    bytes, no W4A16 copy kept), greedy tokens and logits close to transformers' fp32 forward; with the INT8
    lm_head copy (W8A8 on the same kernels) as well."""
    w4a16 = Engine(EngineConfig(model=str(smollm2_int4), kv_memory="64MiB", threads=2))
    w4a8 = Engine(EngineConfig(model=str(smollm2_int4), kv_memory="64MiB", threads=2, int4_compute="w4a8"))
    proj = w4a8.model.layers[0].mlp.down_proj
    assert isinstance(proj, Int4Linear) and isinstance(proj.weight.native, NativeW4A8)
    assert proj.weight.weight_packed is None  # the W4A8 layout replaces the loaded one
    assert abs(w4a8.weight_bytes / w4a16.weight_bytes - 1) < 0.001  # padding to 16-row tiles only
    int8_head = EngineConfig(
        model=str(smollm2_int4), kv_memory="64MiB", threads=2, int4_compute="w4a8", lm_head_weights="int8"
    )
    w8a8 = Engine(int8_head)
    assert isinstance(w8a8.model.lm_head, Int8Linear) and isinstance(w8a8.model.lm_head.weight, NativeW8A8)
    hf = hf_reference(smollm2_int4)
    for engine in (w4a8, w8a8):
        agreements, kls = [], []
        for prompt in chat_prompts[:2]:
            continuation = hf_greedy(hf, prompt, NUM_TOKENS)
            expected = hf_logits(hf, prompt + continuation)[len(prompt) - 1 :]
            found = teacher_forced_logits(engine, prompt, continuation)
            agreements.append((found.argmax(-1) == expected.argmax(-1)).float().mean())
            kl = F.kl_div(found.log_softmax(-1), expected.log_softmax(-1), log_target=True, reduction="none")
            kls.append(kl.sum(-1))
        assert torch.stack(agreements).mean() >= 0.8, agreements
        assert torch.cat(kls).median() < 0.05, kls
        text = engine.generate([chat_prompts[0]], SamplingParams(max_tokens=12))[0].text
        assert "Paris" in text
