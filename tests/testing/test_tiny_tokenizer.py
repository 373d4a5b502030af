"""The fixture tokenizer: deterministic byte-level BPE over gensim's English text, with a chat template."""

from __future__ import annotations

from kvq.testing import tiny_tokenizer as module
from kvq.testing.tiny_tokenizer import VOCAB_SIZE, tiny_tokenizer


def test_training_is_deterministic():
    assert module._trained_tokenizer_json.__wrapped__() == module._trained_tokenizer_json()


def test_tokenizer_round_trips_text_and_formats_chat():
    tokenizer = tiny_tokenizer()
    assert len(tokenizer) == VOCAB_SIZE
    text = "Hundreds of people have been forced to vacate their homes — déjà vu, 42°C!"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) < len(text) / 2  # real merges, not bytes
    assert tokenizer.decode(ids) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
    assert tokenizer.bos_token_id == tokenizer.pad_token_id == 0


def test_special_token_id_constants_match_the_trained_tokenizer():
    tokenizer = tiny_tokenizer()
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (module.BOS_TOKEN_ID, module.EOS_TOKEN_ID)
