"""The FP8 KV fake quantization behind the perplexity benchmark, checked against compressed-tensors."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kvq.calibrate.config import CalibrationConfig
from kvq.calibrate.fake_quant import FakeQuantKVCache, fake_quantize_fp8, scales_from_tensors, unit_scales
from kvq.calibrate.perplexity import perplexity
from kvq.calibrate.run import calibrate
from tests.calibrate.conftest import writable
from tests.conftest import TinyCheckpoint


def test_fake_quantize_fp8_round_trip() -> None:
    x = torch.tensor([[[[0.0, 0.013, -1.0, 3.7, 1000.0]]]])  # [1, 1, 1, 5]
    out = fake_quantize_fp8(x, torch.tensor([0.01]))
    expected = (x / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 0.01
    assert torch.equal(out, expected)
    assert out[0, 0, 0, -1] == torch.tensor(448.0) * torch.tensor(0.01)  # clipped at the e4m3 max
    per_head = fake_quantize_fp8(torch.ones(1, 2, 3, 4), torch.tensor([1.0, 4.0]).reshape(2, 1, 1))
    assert per_head.shape == (1, 2, 3, 4) and torch.equal(per_head, torch.ones(1, 2, 3, 4))


def test_matches_compressed_tensors_kv_quantization(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path, small_dataset: Path
) -> None:
    """transformers + compressed-tensors run the calibrated checkpoint with its own KV fake quantization:
    same logits as FakeQuantKVCache on the plain model (fp32, where neither rounds x / scale to bf16)."""
    source = tiny_checkpoint("llama", "bf16")
    root = writable(source, tmp_path)
    result = calibrate(root, CalibrationConfig(dataset=small_dataset, num_samples=4, seq_len=64))
    ids = result.samples.input_ids[:2]
    plain = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with_kv_scheme = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    scales = scales_from_tensors(result.scales, 2)
    with torch.no_grad():
        expected = with_kv_scheme(ids).logits
        ours = plain(ids, past_key_values=FakeQuantKVCache(plain.config, scales), use_cache=True).logits
        unquantized = plain(ids).logits
    assert torch.equal(ours, expected)
    assert not torch.equal(ours, unquantized)
    assert perplexity(plain, ids, None) < perplexity(
        plain, ids, {i: (s * 1000, s * 1000) for i, (s, _) in unit_scales(2).items()}
    )
