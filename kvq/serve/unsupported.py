"""Request fields of OpenAI's and vLLM's APIs that kvq knows but cannot honour: a request that asks for one
(a value other than its "off" value) gets a 400 naming the field, rather than an answer that silently
ignores what it asked. Fields of these APIs that change nothing in kvq's answer (`user`, `metadata`,
`store`, `spaces_between_special_tokens`, ...) are simply ignored. Imports nothing of kvq.
"""

from __future__ import annotations

from typing import Any

# fields of these APIs that change nothing in kvq's answer: accepted without a warning
HARMLESS = frozenset(
    {"spaces_between_special_tokens", "parallel_tool_calls", "metadata", "store", "service_tier",
     "reasoning_effort", "include_reasoning"}
)  # fmt: skip
# field -> (values that ask for nothing, what to say)
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": ((None, ""), "kvq does not implement insertion (suffix)"),
    "use_beam_search": ((None, False), "kvq does not implement beam search"),
    "length_penalty": ((None, 1, 1.0), "length_penalty applies to beam search, which kvq does not implement"),
    "tools": ((None, []), "kvq does not implement tool calling; send no tools"),
    "functions": ((None, []), "kvq does not implement function calling; send no functions"),
    "tool_choice": ((None, "none", "auto"), "kvq does not implement tool calling"),
    "function_call": ((None, "none", "auto"), "kvq does not implement function calling"),
    "bad_words": ((None, []), "kvq does not implement bad_words"),
    "allowed_token_ids": ((None,), "kvq does not implement allowed_token_ids"),
    "guided_json": ((None,), "kvq does not implement guided decoding"),
    "guided_regex": ((None,), "kvq does not implement guided decoding"),
    "guided_choice": ((None,), "kvq does not implement guided decoding"),
    "guided_grammar": ((None,), "kvq does not implement guided decoding"),
    "structured_outputs": ((None,), "kvq does not implement structured outputs"),
    "logits_processors": ((None, []), "kvq does not take logits processors"),
    "prompt_embeds": ((None,), "kvq takes prompts as text or token ids, not embeddings"),
    "chat_template": ((None,), "kvq uses the checkpoint's chat template; send none"),
    "priority": ((None, 0), "kvq schedules first come, first served; send priority 0"),
    "audio": ((None,), "kvq serves text only"),
    "modalities": ((None, ["text"]), "kvq serves text only"),
    "prediction": ((None,), "kvq does not implement predicted outputs"),
}


def refuse_unsupported(body: dict[str, Any]) -> None:
    """`ValueError` (a 400) naming the first field of `body` that asks for something kvq cannot do."""
    for name, (off, why) in UNSUPPORTED.items():
        if name in body and not _is_off(body[name], off):
            raise ValueError(f"{name}: {why}")
    best_of, n = body.get("best_of"), body.get("n") or 1
    if best_of is not None and best_of != n:
        raise ValueError("best_of: kvq returns every choice it samples; send best_of equal to n, or none")
    response_format = body.get("response_format")
    if response_format is not None and not (
        isinstance(response_format, dict) and response_format.get("type") == "text"
    ):
        raise ValueError("response_format: kvq does not implement JSON or schema output; send type 'text'")


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    return any(value == o and type(value) is type(o) for o in off if o is not None) or value is None
