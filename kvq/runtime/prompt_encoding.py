"""Prompts to token ids: plain text, and conversations through the tokenizer's chat template.

One place for both the engine (`Engine.encode*`) and the HTTP server, which encodes on its own thread
with its own tokenizer copy (a tokenizer is not shared between threads). Imports only the tokenizer given.
"""

from __future__ import annotations

from typing import Any

from kvq.errors import KvqError


def encode_text(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, verbose=False)  # length is checked by Engine.make_sequence, not here


def encode_messages(tokenizer: Any, messages: list[dict[str, str]], where: str) -> list[int]:
    """A conversation (`role`/`content` dicts) through the chat template, ready for the assistant's turn;
    `KvqError` if the tokenizer (of checkpoint `where`) has no chat template."""
    if not tokenizer.chat_template:
        raise KvqError(f"{where}: the tokenizer has no chat template; send a plain prompt (/v1/completions)")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False, verbose=False)
