"""One request as the scheduler and the block manager track it: its tokens, its pages, its sampling state.

What other subsystems keep about a request lives with them, by `seq_id`: the integrity tracker's expected
tags, teacher forcing's given tokens (`kvq.runtime.scoring`), the engine's text (`kvq.runtime.detokenizer`).
Imports torch and kvq.runtime.sampling_params.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from kvq.runtime.sampling_params import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Prompt + completion tokens. `block_table[i]` is the page holding tokens [i*P, (i+1)*P); the first
    `num_cached_tokens` tokens were found in shared prefix pages when it was last admitted.
    `last_page_hash` chains its own full pages (0: none yet); `last_page_serial` is the sealing serial of
    its last full page (0: none yet), which the next page it seals records as its predecessor."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    max_len: int  # prompt + max_tokens, capped at the model's context
    generator: torch.Generator | None = None
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    last_page_hash: int = 0  # block_manager.ROOT_HASH
    last_page_serial: int = 0
    num_preemptions: int = 0
    num_sealed_pages: int = 0  # of `block_table`, the first ones: full of its tokens, hashed
    finish_reason: str | None = None  # "stop" | "length" | "error" | "abort"
    error: str | None = None
    needs_prompt_logprobs: bool = False  # asked for them and not scored yet: prefilled whole, no cache hits

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def num_drafts(self, num_speculative_tokens: int) -> int:
        """Tokens to draft this step (`--speculative`): a verified step emits up to one more than it drafts,
        and never past `max_len`."""
        return max(0, min(num_speculative_tokens, self.max_len - self.num_tokens - 1))
