"""Hypothesis strategies of request bodies for `/v1/completions` and `/v1/chat/completions`: random JSON
under random and known field names, wrong types, huge numbers, nested junk, mutations of valid bodies,
and bytes that are not JSON at all. Imports hypothesis only."""

from __future__ import annotations

import json
import math

from hypothesis import strategies as st

COMPLETION = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Hello there"}],
    "max_tokens": 4,
    "temperature": 0,
}
# OpenAI's fields, vLLM's extensions and names neither has: what clients send
FIELDS = (
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "min_p", "n", "best_of", "stream", "stream_options", "stop", "stop_token_ids", "seed", "echo", "logprobs",
    "top_logprobs", "prompt_logprobs", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "user", "suffix", "skip_special_tokens", "include_stop_str_in_output",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "response_format", "tools", "tool_choice",
    "add_generation_prompt", "continue_final_message", "chat_template", "guided_json", "priority",
    "parallel_tool_calls", "service_tier", "metadata", "store", "modalities", "reasoning_effort",
)  # fmt: skip
HUGE = (2**31, 2**63, -(2**63) - 1, 10**30, -(10**30), 1e308, -1e308, 1e-320, math.inf, -math.inf, math.nan)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-3, max_value=70)
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.sampled_from(HUGE)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=24)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=16,
)
token_ids = st.integers(min_value=-5, max_value=70_000) | st.sampled_from([2**31, 2**63, 10**30])
prompts = (
    st.text(max_size=60)
    | st.lists(token_ids, max_size=12)
    | st.lists(st.text(max_size=20), max_size=3)
    | st.lists(st.lists(token_ids, max_size=6), max_size=3)
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "robot", ""]),
        "content": st.text(max_size=40)
        | st.none()
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=20)}
            )
        ),
    },
    optional={"name": st.text(max_size=8), "tool_calls": json_values},
)
plausible = {
    "prompt": prompts,
    "messages": st.lists(message, max_size=4),
    "max_tokens": st.integers(min_value=-2, max_value=20) | st.none(),
    "max_completion_tokens": st.integers(min_value=-2, max_value=20) | st.none(),
    "min_tokens": st.integers(min_value=-2, max_value=30),
    "temperature": st.floats(min_value=-1, max_value=3) | st.sampled_from(HUGE),
    "top_p": st.floats(min_value=-0.5, max_value=1.5),
    "top_k": st.integers(min_value=-2, max_value=100_000),
    "min_p": st.floats(min_value=-0.5, max_value=1.5),
    "n": st.integers(min_value=-1, max_value=20),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=5) | st.none(),
    "stop_token_ids": st.lists(token_ids, max_size=4),
    "seed": st.integers(min_value=-(2**64), max_value=2**64),
    "echo": st.booleans(),
    "logprobs": st.integers(min_value=-1, max_value=30) | st.booleans(),
    "top_logprobs": st.integers(min_value=-1, max_value=30),
    "prompt_logprobs": st.integers(min_value=-1, max_value=30),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(min_value=-3, max_value=3),
    "frequency_penalty": st.floats(min_value=-3, max_value=3),
    "repetition_penalty": st.floats(min_value=-1, max_value=3),
    "logit_bias": st.dictionaries(
        st.text(max_size=6) | token_ids.map(str), st.floats(min_value=-200, max_value=200)
    ),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
}
field_names = st.sampled_from(FIELDS) | st.text(max_size=12)


def _value(name: str) -> st.SearchStrategy:
    return plausible[name] | json_values if name in plausible else json_values


@st.composite
def bodies(draw: st.DrawFn, valid: dict) -> bytes:
    """One request body: `valid` with fields set (plausible or junk values) or deleted, a dict of junk, or
    bytes that are not a JSON object."""
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "junk", "not_an_object"]))
    if kind == "not_an_object":
        return draw(
            st.binary(max_size=64)
            | json_values.map(lambda v: json.dumps(v).encode())
            | st.sampled_from([b"", b"{", b'{"prompt": NaN}', b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000])
        )
    body = dict(valid) if kind == "mutated" else {}
    for _ in range(draw(st.integers(min_value=1, max_value=5))):
        name = draw(st.sampled_from(sorted(plausible)) | field_names)
        if kind == "mutated" and name in body and draw(st.booleans()):
            del body[name]
        else:
            body[name] = draw(_value(name))
    return json.dumps(body).encode()  # NaN and Infinity as Python writes them: what sloppy clients send
