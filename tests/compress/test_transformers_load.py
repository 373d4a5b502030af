"""transformers (through compressed-tensors) loads both targets of kvq's output of every fixture, holds
kvq's dequantized weights, and generates.

In the `vllm` target FP8-block parts are kept as compressed-tensors block FP8 with dynamic per-group (128)
input activations, as the FP8 source is served; transformers holds their fp32 block scales in the model
dtype (bf16), so those weights are compared with bf16-rounded scales. compressed-tensors' fake-quantized
forward cannot run such a Linear whose in_features is not a multiple of that group
(`compute_dynamic_scales_and_zp` unflattens the input into groups of 128), so kvq writes the fixtures'
partial blocks (in 192, 576) as BF16, in both targets: every output generates.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

from kvq.checkpoint.dense import read_dense
from kvq.checkpoint.expert_layout import fuse_experts
from kvq.checkpoint.reader import Checkpoint
from kvq.fixtures.tiny_models import tiny_config
from kvq.formats.fp8_block import dequantize_fp8_block
from tests.compress.conftest import compress
from tests.compress.synthetic import random_checkpoint

# Passing dequantize= overrides only that loading attribute of the config; transformers warns anyway.
pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
PROMPT = torch.tensor([[1, 40, 41, 42, 43, 44]])
RECIPES = {
    "llama": "w4a16-linear",
    "glm4_moe": "w4a16-experts",
    "glm_moe_dsa": "w4a16-experts",
    "deepseek_v3": "w4a16-experts",
}


def load(path: Path, *, dequantize: bool = True):
    """dequantize=True: compressed-tensors decompresses every weight at load; False: on the first forward."""
    model, info = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.bfloat16,
        output_loading_info=True,
        quantization_config=CompressedTensorsConfig(dequantize=dequantize),
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def kvq_weights(out: Path) -> dict[str, torch.Tensor]:
    """kvq's own dequantization of its output; FP8 block scales rounded to bf16 as transformers holds them."""
    ckpt = Checkpoint.open(out)
    dense = read_dense(ckpt, "", torch.float32)
    for name, info in ckpt.tensors.items():
        if info.dtype == "F8_E4M3":
            scale = ckpt.read(f"{name}_scale").bfloat16().float()
            dense[name] = dequantize_fp8_block(ckpt.read(name), scale)
    return fuse_experts(dense)


def assert_holds_kvqs_weights(model, out: Path) -> None:
    expected = kvq_weights(out)
    state = model.state_dict()
    compared = [name for name in expected if name in state]
    assert len(compared) >= len(expected) - 1  # a tied lm_head is the only one that may be absent
    for name in compared:
        assert torch.equal(state[name], expected[name].to(state[name].dtype)), name


def generate(model) -> torch.Tensor:
    out = model.generate(PROMPT, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (1, PROMPT.shape[1] + 6)
    return out


# A BF16 source gives the same bytes for both targets (nothing is FP8): one of them is enough.
OUTPUTS = [(arch, "bf16", "vllm") for arch in RECIPES] + [
    (arch, "fp8-block", target) for arch in RECIPES for target in ("vllm", "sglang")
]


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "fmt", "target"), OUTPUTS)
def test_output_loads_with_kvqs_weights_and_generates(compressed, arch, fmt, target):
    out = compressed(arch, fmt, RECIPES[arch], target=target)
    model = load(out)
    assert_holds_kvqs_weights(model, out)
    ids = generate(model)
    if fmt == "bf16":  # decompressing on load or on the first forward: the same model
        assert torch.equal(ids, generate(load(out, dequantize=False)))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "glm_moe_dsa"])
def test_block_aligned_fp8_source_output_generates(tmp_path, arch):
    config = tiny_config(arch)
    config.intermediate_size = 512
    if arch == "glm_moe_dsa":
        config.q_lora_rank = 256
    src = random_checkpoint(tmp_path / "src", config, "fp8-block")
    out = compress(src, tmp_path / "out", "w4a16-experts")
    model = load(out)
    assert_holds_kvqs_weights(model, out)
    generate(model)


@pytest.mark.slow
def test_compressed_smollm2_still_answers(smollm2, tmp_path):
    # Group 64 quantizes every Linear of SmolLM2 (hidden 576); the FP8 source leaves nothing FP8 behind.
    out = compress(smollm2.fp8, tmp_path / "smollm2-int4", "w4a16-linear", group_size=64)
    model = load(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
    )["input_ids"]
    answer = model.generate(chat, max_new_tokens=12, do_sample=False)[0, chat.shape[1] :]
    assert "Paris" in tokenizer.decode(answer, skip_special_tokens=True)
