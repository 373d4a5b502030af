"""`--speculative mtp` on the fast path (bf16 activations, BF16 latent pages, INT4 experts), on the CPU and
on CUDA (gpu-marked: scripts/gpu_check.sh) through the compiled Triton kernels a speculative step needs:
the fused MoE over the K + 1 rows each request verifies, and the latent decode attention of the MTP
layer's chained drafts. At 16-bit activations greedy output is not bit-identical to decoding without
speculation (verification runs K + 1 rows through the prefill attention, a decode step one row through
the decode path), so each emitted token must be the plain engine's own argmax, teacher-forced along the
output, or within bf16 rounding of it; and almost all must be the argmax exactly.
"""

from __future__ import annotations

import pytest
import torch

import kvq.runtime.kernels.triton.fused_moe as fused_moe_triton
import kvq.runtime.kernels.triton.latent_attention as latent_attention_triton
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.sampling import SamplingParams
from tests.runtime.reference import teacher_forced_logits

K = 3
NUM_TOKENS = 12
PROMPTS = [[1, 5, 9, 200, 33, 7, 8, 9, 10, 11, 12, 13][: 5 + 3 * i] for i in range(3)]


def counted(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Rows of every call of `module.name` (a Triton launcher, imported by its callers at the call)."""
    launch, rows = getattr(module, name), []

    def counting(*args, **kwargs):
        rows.append(args[0].shape[0])
        return launch(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return rows


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_greedy_emits_the_models_argmax(
    compressed, monkeypatch: pytest.MonkeyPatch, arch: str, device: str
) -> None:
    path = compressed(arch, "bf16", "w4a16-experts", num_mtp_layers=1)
    moe_rows = counted(monkeypatch, fused_moe_triton, "fused_moe_triton")
    latent_rows = counted(monkeypatch, latent_attention_triton, "latent_decode_attention_triton")
    common = {"model": str(path), "kv_cache_dtype": "bf16", "kv_memory": "16MiB", "device": device}
    spec = Engine(EngineConfig(**common, speculative="mtp", num_speculative_tokens=K))
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True)
    ids = [spec.add_request(prompt, params) for prompt in PROMPTS]
    spec.step()  # the prefill
    moe_rows.clear()
    latent_rows.clear()
    outputs: dict[int, list[int]] = {}
    while spec.has_unfinished_requests():
        for out in spec.step():
            outputs[out.request_id] = out.token_ids
    stats = spec.proposer.stats  # type: ignore[union-attr]
    assert stats.num_draft_tokens > 0 and len(stats.accepted_per_pos) == K
    assert spec.block_manager.num_free_pages == spec.block_manager.num_pages  # drafts' pages back
    if device == "cuda":  # the verification of every request's K drafts, and the MTP layer's chained drafts
        assert len(PROMPTS) * (K + 1) in moe_rows, moe_rows
        assert len(PROMPTS) in latent_rows, latent_rows

    plain = Engine(EngineConfig(**common))
    num_exact = 0
    for prompt, tokens in zip(PROMPTS, [outputs[i] for i in ids], strict=True):
        assert len(tokens) == NUM_TOKENS
        logits = teacher_forced_logits(plain, prompt, tokens)[:-1]  # [N, V]: the plain decode's own
        chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        best = logits.max(-1).values
        assert bool((best - chosen <= 0.02 * best.abs() + 0.05).all()), (best - chosen).tolist()
        num_exact += int((chosen == best).sum())
    assert num_exact >= 0.9 * len(PROMPTS) * NUM_TOKENS
