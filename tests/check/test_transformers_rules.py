"""kvq check's transformers answer against transformers itself: FP8-block Linears kept with a partial input
block (what kvq compress wrote before it wrote them as BF16) load but cannot run, and kvq check says so."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvq.check import check_checkpoint
from kvq.compress import tensor_plan
from tests.compress.conftest import compress

pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")


@pytest.mark.slow
def test_partial_fp8_blocks_are_predicted_to_fail_and_do(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(tensor_plan, "_dequantize_reason", lambda *args: None)  # keep every FP8 weight FP8
    out = compress(tiny_checkpoint("glm_moe_dsa", "fp8-block"), tmp_path / "out", workers=1)
    verdict = check_checkpoint(out, ["transformers"]).verdict("transformers")
    failing = {f.where for f in verdict.findings if f.rule == "transformers.dynamic-group-input"}
    assert "model.layers.0.self_attn.q_b_proj" in failing  # in_features 192 = q_lora_rank
    assert "model.layers.0.mlp.down_proj" in failing  # in_features 576
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)  # it loads ...
    with pytest.raises(RuntimeError, match="unflatten"):  # ... and the first forward fails
        model(torch.tensor([[1, 40, 41, 42]]))
