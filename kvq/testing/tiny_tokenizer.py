"""A small real tokenizer for test fixtures: byte-level BPE trained on gensim's bundled English text.

Deterministic (same text, same trainer settings, same merges), trained once per process (0.1 s) and
saved next to each fixture as a `PreTrainedTokenizerFast` with ChatML special tokens and chat template.
Imports only `tokenizers`/`transformers`; gensim is located on disk, never imported.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvq.errors import KvqError

VOCAB_SIZE = 2000
BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2: trained in first
BOS_TOKEN_ID = SPECIAL_TOKENS.index(BOS_TOKEN)
EOS_TOKEN_ID = SPECIAL_TOKENS.index(EOS_TOKEN)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Real English prose shipped in gensim's wheel: Lee news corpus and Wikipedia paragraphs.
TRAINING_FILES = ("lee_background.cor", "para2para_text1.txt", "para2para_text2.txt")


def gensim_test_data_dir() -> Path:
    """`gensim/test/test_data/` of the installed gensim, found without importing gensim."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise KvqError(
            "gensim is not installed; it provides the fixture tokenizer's training text: "
            "pip install 'gensim>=4.3.3' (or `pip install -e .[dev]`)"
        )
    return Path(spec.submodule_search_locations[0]) / "test" / "test_data"


def training_lines() -> list[str]:
    """The training text, one line per paragraph, in a fixed order."""
    root = gensim_test_data_dir()
    lines: list[str] = []
    for name in TRAINING_FILES:
        path = root / name
        try:
            lines += path.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise KvqError(f"{path}: cannot read fixture tokenizer text ({e}); reinstall gensim") from e
    return lines


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_lines(), trainer)
    return tokenizer.to_str()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh `PreTrainedTokenizerFast` over the cached trained BPE (safe to mutate)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=BOS_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )
