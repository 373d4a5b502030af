"""What a request must be before it is queued (`Engine.make_sequence`): a prompt of token ids in the
vocabulary, logit bias and stop ids in it too, room to generate within `max_model_len`, and few enough KV
pages for the pool. Each failure is a `KvqError` saying the fix. Imports kvq.errors and kvq.runtime.
"""

from __future__ import annotations

from kvq.errors import KvqError
from kvq.runtime.block_manager import BlockManager
from kvq.runtime.sampling_params import SamplingParams


def check_request(
    token_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    block_manager: BlockManager,
) -> int:
    """The most tokens the request may hold (prompt + completion, within `max_model_len`), once it is
    checked; raises `KvqError`."""
    if not token_ids:
        raise KvqError("the prompt is empty; pass at least one token")
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise KvqError(f"the prompt holds token ids outside the vocabulary [0, {vocab_size})")
    if any(not 0 <= t < vocab_size for t in (*params.logit_bias, *params.stop_token_ids)):
        raise KvqError(f"logit_bias and stop_token_ids take token ids in the vocabulary [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise KvqError(
            f"the prompt has {len(token_ids)} tokens but the context holds {max_model_len} "
            "(max_model_len), leaving no room to generate; shorten the prompt"
        )
    max_len = min(len(token_ids) + params.max_tokens, max_model_len)
    num_pages = block_manager.pages_for(max_len)
    if num_pages > block_manager.num_pages:
        raise KvqError(
            f"a request of {max_len} tokens needs {num_pages} KV pages but the pool has "
            f"{block_manager.num_pages}; raise --kv-memory or lower --max-tokens"
        )
    return max_len
