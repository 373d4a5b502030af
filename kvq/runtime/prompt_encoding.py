"""Prompts to token ids: plain text, and conversations through the tokenizer's chat template; and the
ids that end a completion.

One place for both the engine (`Engine.encode*`) and the HTTP server, which encodes on its own thread
with its own tokenizer copy (a tokenizer is not shared between threads). Imports only the tokenizer given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import GenerationConfig

from kvq.errors import KvqError

# apply_chat_template's own arguments: not for a request's chat_template_kwargs to set
TEMPLATE_ARGUMENTS = frozenset(
    {"conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
     "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
     "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    # length is checked by `request_checks`, not here
    return tokenizer.encode(text, add_special_tokens=add_special_tokens, verbose=False)


def encode_messages(
    tokenizer: Any,
    messages: list[dict[str, str]],
    where: str,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """A conversation (`role`/`content` dicts) through the chat template, ready for the assistant's turn
    (unless `add_generation_prompt` is False); `template_kwargs` are the template's own variables (e.g.
    `enable_thinking`). `KvqError` if the tokenizer (of checkpoint `where`) has no chat template, or if the
    template refuses the conversation (e.g. roles that do not alternate)."""
    if not tokenizer.chat_template:
        raise KvqError(f"{where}: the tokenizer has no chat template; send a plain prompt (/v1/completions)")
    extra = {k: v for k, v in (template_kwargs or {}).items() if k not in TEMPLATE_ARGUMENTS}
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
    except Exception as e:  # jinja2's TemplateError and what a template raises on odd input
        raise KvqError(f"the chat template refused the messages: {e}") from e
    return tokenizer.encode(text, add_special_tokens=False, verbose=False)


def encode_chat(tokenizer: Any, prompt: str, where: str) -> list[int]:
    """`prompt` as one user turn through the chat template (`encode_messages`), or plain text
    (`encode_text`) when the tokenizer (of checkpoint `where`) has none."""
    if not tokenizer.chat_template:
        return encode_text(tokenizer, prompt)
    return encode_messages(tokenizer, [{"role": "user", "content": prompt}], where)


def eos_token_ids(tokenizer: Any, root: Path, config_fields: dict[str, Any]) -> set[int]:
    """Every id that ends a completion: generation_config.json's (else config.json's) and the tokenizer's."""
    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(root).eos_token_id
    except OSError:  # no generation_config.json
        eos = config_fields.get("eos_token_id")
    for value in (eos, tokenizer.eos_token_id):
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return ids
