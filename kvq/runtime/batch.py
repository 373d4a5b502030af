"""What one model call needs besides the weights: token ids, positions, KV slots and page tables.

Built on the host by `ModelRunner.prepare` and passed down explicitly (no global context); everything
every layer would otherwise re-derive (page ids, length masks) is made here once per step.
Imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvq.runtime.kernels import DecodeTables, PagedDecodePlan


@dataclass(frozen=True)
class WriteGuard:
    """The checked pool's guard on a batch's K/V writes (`kernels.integrity.step_check.guard_slot_mapping`):
    a write lands only if its page still carries the tag it was checked against."""

    page_tags: torch.Tensor  # [P] int64: the pool's device tag table (live)
    write_tags: torch.Tensor  # [T] int64: each new token's page tag at the check


# What a batch runs (`StepInputs.kind`): the model (logits of each sequence's last row), the model over a
# request's last token and its drafts (logits of every row: `--speculative mtp` verifies them), or the MTP
# layer over the rows the model just ran (`MTP_EXTEND`) or over its own previous drafts (`MTP_DRAFT`).
TARGET, VERIFY, MTP_EXTEND, MTP_DRAFT = "target", "verify", "mtp_extend", "mtp_draft"


@dataclass(frozen=True)
class StepInputs:
    """A step's batch as plain lists (what tensor-parallel rank 0 broadcasts; each rank makes its
    `ForwardBatch` from it): the new tokens' ids, positions and slots, per sequence its query length,
    context length, prompt length and page table (padded with -1); in a prefill, the top log-probabilities
    each sequence wants of its prompt's tokens (-1: none; empty: none in the batch). `kind`: what runs it
    (TARGET, VERIFY, MTP_EXTEND, MTP_DRAFT); the MTP layer's previous hidden states are, for MTP_EXTEND, the
    rows `hidden_rows` of the model's last forward (every rank kept its own), for MTP_DRAFT
    `previous_hidden` `[B, H]`, one row per sequence (rank 0's, sent along)."""

    is_prefill: bool
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    context_lens: list[int]
    prompt_lens: list[int]
    block_tables: list[list[int]]
    prompt_logprobs: tuple[int, ...] = ()
    kind: str = TARGET
    hidden_rows: tuple[int, ...] = ()
    previous_hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class ForwardBatch:
    """One step over B sequences: all prefill (their uncached prompt tokens) or all decode (one token each).

    `block_tables` int32 `[B, max_pages]` (padding -1) as the kernels take them; `slot_mapping` int64
    `[T]` = page * page_size + offset where each new token's K/V goes; `context_lens` = tokens each
    sequence attends to after this step; prefill: `query_lens` = new tokens per sequence (the rest of the
    context is cached pages); decode: `decode_tables(backend)`, what every layer's decode attention reads,
    with `decode_plan` for the torch kernels (the context slots, past a sequence's end a slot of the pool's
    zero page, and length mask), made once, when the first layer reads it (a CPU decode plan or the Triton
    kernels never do).
    """

    is_prefill: bool
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_pages] int32
    context_lens: torch.Tensor  # [B] int32
    context_lens_list: list[int]
    max_context_len: int
    query_lens: list[int]  # [B]
    logits_indices: torch.Tensor  # [B] int64: the row of each sequence's last token in [T]
    prompt_lens: list[int]  # [B]: the request's prompt tokens (GLM-5's indexer forms its score rows by it)
    decode_plan_of: Callable[[], PagedDecodePlan] | None = None  # decode only: makes `decode_plan`
    write_guard: WriteGuard | None = None  # --kv-integrity tags/full only: applied once per forward
    slot_stamps: torch.Tensor | None = None  # [T] int64, tags/full only: each new token's slot stamp
    inputs: StepInputs | None = None  # what it was made from
    _made: dict[str, Any] = field(init=False, default_factory=dict, repr=False, compare=False)

    def guarded(self, write_guard: WriteGuard, slot_stamps: torch.Tensor | None) -> ForwardBatch:
        """This batch with a write guard and slot stamps (`TagTracker.guard`): `dataclasses.replace`'s result
        (a fresh decode plan cache), made without re-running `__init__` (once per checked step)."""
        fields = self.__dict__ | {"write_guard": write_guard, "slot_stamps": slot_stamps, "_made": {}}
        guarded = object.__new__(type(self))
        guarded.__dict__.update(fields)
        return guarded

    @property
    def decode_plan(self) -> PagedDecodePlan | None:
        if self.decode_plan_of is None:
            return None
        if "plan" not in self._made:
            self._made["plan"] = self.decode_plan_of()
        return self._made["plan"]

    def decode_tables(self, backend: str) -> DecodeTables:
        """What decode attention on `backend`'s pages reads: the tables, with `decode_plan` for the torch
        kernels (Triton does its own index work); made once a step, when the first layer asks."""
        key = f"tables {backend}"
        if key not in self._made:
            plan = self.decode_plan if backend == "torch" else None
            self._made[key] = DecodeTables(self.block_tables, self.context_lens, self.max_context_len, plan)
        return self._made[key]
