"""A completion's text, token by token, at a cost per token that does not grow with the completion.

The technique of vLLM's `detokenize_incrementally`: each new token is turned into text by decoding only a
short window of the latest tokens, `tokens[prefix_offset:]`, and removing what the same window gave without
the new token, `tokens[prefix_offset:read_offset]`. Decoding the window (not the token alone) keeps what
depends on neighbours right (a leading space, a UTF-8 character split over byte tokens); text that ends in
an incomplete character (U+FFFD) is held back until the character is complete. An id the tokenizer does not
have (a checkpoint whose embedding is padded past its tokenizer) has no text: it adds nothing, as in vLLM
(the id itself stays in the request's token ids). `CompletionText` adds stop strings, searched only where new
text can complete one, and the streamed part. Imports nothing but the tokenizer it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"  # what a decoder gives for the bytes of a character not yet complete
# a transformers tokenizer: `convert_ids_to_tokens(ids, skip_special_tokens=True)` and
# `convert_tokens_to_string(tokens)` are all this file uses
Tokenizer = Any


class IncrementalDetokenizer:
    """`add(token_id)` -> the text that token completes ("" while it is held back); `text` so far.

    At the end, `flush()` gives what is still held back (an incomplete character decodes as U+FFFD, as a
    full decode of the token ids would). Special tokens are skipped unless `skip_special_tokens` is False.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[str] = []
        self.prefix_offset = 0  # the window decoded for each new token starts here
        self.read_offset = 0  # tokens before this one are in `text`
        self.text = ""

    def add(self, token_id: int) -> str:
        skip = self.skip_special_tokens
        tokens = self.tokenizer.convert_ids_to_tokens([token_id], skip_special_tokens=skip)
        self.tokens += [t for t in tokens if t is not None]  # None: an id the tokenizer lacks
        return self._advance(is_final=False)

    def flush(self) -> str:
        return self._advance(is_final=True)

    def _advance(self, *, is_final: bool) -> str:
        if self.read_offset == len(self.tokens):
            return ""
        decode = self.tokenizer.convert_tokens_to_string
        prefix_text = decode(self.tokens[self.prefix_offset : self.read_offset])
        window_text = decode(self.tokens[self.prefix_offset :])
        if not is_final and (len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR)):
            return ""
        delta = window_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        return delta


class CompletionText:
    """One request's text: new tokens in, stop strings found, and the part safe to stream out.

    `add(token_id, is_last)` returns True when a stop string ended the text (cut before it, or after it
    with `include_stop_str_in_output`); `can_stop=False` (vLLM's `min_tokens` not reached yet) adds the text
    without looking for stop strings. `take()` gives the text new since the last take, holding back what
    may still become a stop string.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str],
        *,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.hold = max((len(s) - 1 for s in self.stop), default=0)  # longest unfinished stop string
        self.text = ""  # the completion's text, stop string cut off
        self.num_sent = 0  # characters of `text` already taken
        self.is_stopped = False

    def add(self, token_id: int, *, is_last: bool, can_stop: bool = True) -> bool:
        if self.is_stopped:
            return True
        delta = self.detokenizer.add(token_id)
        if is_last:
            delta += self.detokenizer.flush()
        if not delta:
            return False
        start = max(0, len(self.text) - self.hold)  # a stop string must end inside the new text
        self.text += delta
        if not can_stop:
            return False
        found = [(i, len(s)) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if found:
            cut, length = min(found)
            end = cut + length if self.include_stop_str_in_output else cut
            self.text, self.is_stopped = self.text[:end], True
        return self.is_stopped

    def take(self, is_finished: bool) -> tuple[str, str]:
        """(the text that may be shown now, the part of it new since the last take)."""
        end = len(self.text) if is_finished else max(self.num_sent, len(self.text) - self.hold)
        delta, self.num_sent = self.text[self.num_sent : end], end
        return self.text[:end], delta
