"""The MLA engine on a CUDA device (run by scripts/gpu_check.sh): the fast path (bf16 activations, BF16
and calibrated FP8 latent pages) through the compiled Triton latent decode attention, within the CPU fast
path's bounds of transformers' fp32 forward (`test_mla_fast_path.check_fast_path`: DeepSeek-V3 shaped as
Kimi, GLM-5 with its DSA indexer along the reference's selection), and the Triton launcher did the decode.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import kvq.runtime.kernels.triton.latent_attention as latent_attention_triton
from tests.runtime.test_mla_fast_path import check_fast_path

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
def test_mla_fast_path_on_cuda(
    mla_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    launch, calls = latent_attention_triton.latent_decode_attention_triton, []

    def counted(*args, **kwargs):
        calls.append(args[0].device.type)
        return launch(*args, **kwargs)

    monkeypatch.setattr(latent_attention_triton, "latent_decode_attention_triton", counted)
    check_fast_path(mla_checkpoint(arch, "bf16"), tmp_path, device="cuda")
    assert calls and set(calls) == {"cuda"}, calls
