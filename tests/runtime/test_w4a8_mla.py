"""int4_compute "w4a8" on the MLA models' INT4 experts (GLM-5's glm_moe_dsa compressed by kvq, Kimi K2.6's
native INT4 layout): their stacked experts run the W4A8 kernel, each MoE layer stays within int8 rounding
of its W4A16 run, and so do DeepSeek's logits teacher-forced along the same tokens (GLM-5's tiny random DSA
indexer has near-tied scores whose choice flips with any rounding: test_mla_fast_path says why)."""

from __future__ import annotations

import pytest
import torch

from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.kernels.cpu.w4a8 import w4a8_path
from kvq.runtime.kernels.w4a16 import LAYOUT_W4A8_CPU
from kvq.runtime.layers.moe import Int4Experts
from kvq.runtime.sampling import SamplingParams
from tests.runtime.reference import teacher_forced_logits

pytestmark = pytest.mark.skipif(
    w4a8_path() is None, reason="int4_compute w4a8 needs AVX2 and kvq's CPU extension"
)


def _rel(found: torch.Tensor, expected: torch.Tensor) -> float:
    return ((found.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.parametrize(("arch", "fmt"), [("glm_moe_dsa", "int4-from-bf16"), ("deepseek_v3", "kimi-int4")])
def test_mla_experts_run_w4a8(mla_checkpoint, arch: str, fmt: str) -> None:
    path = str(mla_checkpoint(arch, fmt))
    w4a16 = Engine(EngineConfig(model=path, kv_memory="4MiB", page_size=4))
    w4a8 = Engine(EngineConfig(model=path, kv_memory="4MiB", page_size=4, int4_compute="w4a8"))
    pairs = [
        (a.mlp, b.mlp)
        for a, b in zip(w4a16.model.layers, w4a8.model.layers, strict=True)
        if isinstance(getattr(b.mlp, "experts", None), Int4Experts)
    ]
    assert pairs and all(b.experts.w13.layout == b.experts.w2.layout == LAYOUT_W4A8_CPU for _, b in pairs)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, w4a8.model.config.hidden_size, generator=gen).bfloat16()
    for a, b in pairs:  # routing, shared experts and the routed ones: ~1% apart
        assert _rel(b(x), a(x)) < 0.03
    prompt, forced = (torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (12, 8))
    if arch == "deepseek_v3":
        expected = teacher_forced_logits(w4a16, prompt, forced)
        assert _rel(teacher_forced_logits(w4a8, prompt, forced), expected) < 0.03
    out = w4a8.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.error is None
