"""Prompts to token ids (and token ids to echoed text) for the HTTP handlers, off the event loop and off
the engine thread: a tokenizer of the server's own on one worker thread (tokenizers are not shared
between threads). Imports transformers and kvq.runtime.prompt_encoding.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from kvq.runtime.prompt_encoding import encode_messages, encode_text


class PromptEncoder:
    def __init__(self, model_dir: Path) -> None:
        self.where = str(model_dir)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvq-tokenizer")

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def encode(
        self, prompt: str | list[int], add_special_tokens: bool = True
    ) -> tuple[list[int], str | None]:
        """(token ids, the prompt's text when it was given as text)."""
        if isinstance(prompt, str):
            return await self._run(encode_text, self.tokenizer, prompt, add_special_tokens), prompt
        return list(prompt), None

    async def encode_messages(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """`KvqError` (a 400) when the tokenizer has no chat template or the template refuses them."""
        return await self._run(
            encode_messages, self.tokenizer, messages, self.where, add_generation_prompt, template_kwargs
        )

    async def decode(self, token_ids: list[int]) -> str:
        """The text of token ids (an id the tokenizer lacks has none)."""
        return await self._run(lambda: self.tokenizer.decode(token_ids))

    def close(self) -> None:
        self._worker.shutdown(wait=False)
