"""The device side of the runtime: `ModelRunner` owns this rank's model and KV pool (`model_load`), turns
sequences into a step's batch on the host (sequences -> `StepInputs`, plain lists, what tensor-parallel rank
0 broadcasts -> `ForwardBatch`) and runs it (logits in the lm_head's dtype: bf16, or fp32 in reference
mode; in a prefill, the prompt scores that were asked for). Ranks past 0 run `loop()`: rank 0's steps, and
with the checked pool their own page checks (`integrity.ranks`), over the runner and a tracker of their
own, until rank 0 says stop.

Imports torch and kvq.runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from kvq.checkpoint.kv_cache_spec import heads_per_rank
from kvq.runtime.batch import MTP_DRAFT, MTP_EXTEND, TARGET, VERIFY, ForwardBatch, StepInputs, WriteGuard
from kvq.runtime.config import EngineConfig
from kvq.runtime.decode_plan import DecodePlans
from kvq.runtime.distributed.group import STOP
from kvq.runtime.integrity import make_tracker
from kvq.runtime.integrity.ranks import RankCheck, RankReset, RankStep
from kvq.runtime.integrity.tracker import TagTracker
from kvq.runtime.kernels import PagedDecodePlan, plan_paged_decode
from kvq.runtime.kernels.integrity.step_check import guard_slot_mapping
from kvq.runtime.model_load import load_model, make_kv_pool
from kvq.runtime.prompt_logprobs import PromptScores, score_prompt
from kvq.runtime.request import Request

if TYPE_CHECKING:
    from kvq.runtime.integrity.ranks import RankLeader


@dataclass(frozen=True)
class ForwardOutput:
    """A step's logits `[B, V]` and, in a prefill, the prompt scores of the rows that asked (by row)."""

    logits: torch.Tensor
    prompt_scores: dict[int, PromptScores] = field(default_factory=dict)
    hidden: torch.Tensor | None = None  # an MTP forward: its last rows' hidden states `[B, H]`


class StepBatches:
    """Host-side batch preparation alone (what the tests of the kernels and the checked pool drive without a
    model): sequences -> `StepInputs` -> this rank's `ForwardBatch`."""

    def __init__(self, page_size: int, zero_page: int, num_kv_heads: int, device: torch.device) -> None:
        self.page_size, self.zero_page, self.device = page_size, zero_page, device
        self.num_kv_heads = num_kv_heads  # of this rank's KV pool layout: one for the MLA latent

    def prepare(self, seqs: list[Request], is_prefill: bool) -> ForwardBatch:
        """Prefill: every token after the cached prefix; decode: the last token of each sequence."""
        return self.batch_of(self.inputs_of(seqs, is_prefill))

    def inputs_of(self, seqs: list[Request], is_prefill: bool) -> StepInputs:
        starts = [seq.num_cached_tokens if is_prefill else seq.num_tokens - 1 for seq in seqs]
        wanted = [
            n
            if is_prefill and s.needs_prompt_logprobs and (n := s.params.prompt_logprobs) is not None
            else -1
            for s in seqs
        ]
        return self.span_inputs(
            seqs,
            starts,
            [seq.token_ids[start:] for seq, start in zip(seqs, starts, strict=True)],
            is_prefill,
            prompt_logprobs=tuple(wanted) if any(n >= 0 for n in wanted) else (),
        )

    def span_inputs(
        self,
        seqs: list[Request],
        starts: list[int],
        token_ids: list[list[int]],
        is_prefill: bool,
        **more: object,
    ) -> StepInputs:
        """Each sequence's `token_ids[b]` at positions `starts[b]` on, over the context before them (its
        pages hold the slots: drafts past its tokens included); `more`: `StepInputs`' optional fields."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        for seq, start, ids in zip(seqs, starts, token_ids, strict=True):
            stop = start + len(ids)
            input_ids += ids
            positions += range(start, stop)
            slots += [
                seq.block_table[p // self.page_size] * self.page_size + p % self.page_size
                for p in range(start, stop)
            ]
            query_lens.append(len(ids))
        max_pages = max(len(seq.block_table) for seq in seqs)
        block_tables = [seq.block_table + [-1] * (max_pages - len(seq.block_table)) for seq in seqs]
        context_lens = [start + len(ids) for start, ids in zip(starts, token_ids, strict=True)]
        prompt_lens = [seq.num_prompt_tokens for seq in seqs]
        return StepInputs(
            is_prefill,
            input_ids,
            positions,
            slots,
            query_lens,
            context_lens,
            prompt_lens,
            block_tables,
            **more,  # type: ignore[arg-type]
        )

    def batch_of(self, inputs: StepInputs) -> ForwardBatch:
        """The step's tensors on this rank's device."""

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        context_lens, query_lens = inputs.context_lens, inputs.query_lens
        max_context_len = max(context_lens)
        block_tables_t = tensor(inputs.block_tables, torch.int32)
        context_lens_t = tensor(context_lens, torch.int32)
        decode_plan_of = (
            None
            if inputs.is_prefill
            else partial(self.plan_decode, block_tables_t, context_lens_t, context_lens)
        )
        return ForwardBatch(
            is_prefill=inputs.is_prefill,
            input_ids=tensor(inputs.input_ids, torch.int64),
            positions=tensor(inputs.positions, torch.int64),
            slot_mapping=tensor(inputs.slots, torch.int64),
            block_tables=block_tables_t,
            context_lens=context_lens_t,
            context_lens_list=context_lens,
            max_context_len=max_context_len,
            query_lens=query_lens,
            logits_indices=(
                torch.arange(sum(query_lens))
                if inputs.kind == VERIFY
                else torch.tensor(query_lens).cumsum(0) - 1
            ).to(self.device),
            prompt_lens=inputs.prompt_lens,
            decode_plan_of=decode_plan_of,
            inputs=inputs,
        )

    def plan_decode(
        self, block_tables: torch.Tensor, context_lens: torch.Tensor, context_lens_list: list[int]
    ) -> PagedDecodePlan:
        """The torch decode path's index work for a decode batch (`kernels.plan_paged_decode`)."""
        return plan_paged_decode(
            block_tables,
            context_lens,
            self.page_size,
            self.num_kv_heads,
            max(context_lens_list),
            pad_slot=self.zero_page * self.page_size,
            has_empty=min(context_lens_list) == 0,
        )


class ModelRunner(StepBatches):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.loaded = load_model(config)  # this rank's model and group, and the checkpoint's facts
        self.model, self.tp = self.loaded.model, self.loaded.tp
        self.kv_pool = make_kv_pool(config, self.loaded)
        num_kv_heads = heads_per_rank(self.loaded.kv_spec, self.tp.size)
        super().__init__(config.page_size, self.kv_pool.zero_page, num_kv_heads, config.torch_device)
        self.rank_checks: RankLeader | None = None  # rank 0 at --tp N with --kv-integrity on (`Engine`)
        # CPU decode steps replay C calls bound once per batch size (kvq's CUDA graphs); None: eager
        self.decode_plans = DecodePlans.of(self.model, config.enforce_eager)
        self.mtp = self.loaded.mtp  # --speculative mtp: the draft layer
        self.target_hidden: torch.Tensor | None = None  # with it: the model's last hidden states `[T, H]`

    def loop(self) -> None:
        """Ranks past 0: run rank 0's steps on this rank's shard until rank 0 sends the stop: a bare batch
        (integrity off), or a checked pool's message (this rank's own page checks and guarded writes, over a
        tracker of its own that `RankReset` renews). Then leave the process group: gloo's threads still
        running at interpreter exit abort the process."""
        num_checked = len(self.loaded.model.attention_layers())  # as rank 0's: not the MTP layer's rows
        tracker = make_tracker(self.config.kv_integrity, self.kv_pool, num_checked)
        while True:
            message = self.tp.broadcast(None)
            if isinstance(message, StepInputs):
                self.forward_local(self.batch_of(message))
            elif message == STOP:
                dist.destroy_process_group()
                return
            elif isinstance(message, RankReset):
                tracker = make_tracker(message.kv_integrity, self.kv_pool, num_checked)
            else:
                assert tracker is not None and isinstance(message, RankCheck | RankStep), type(message)
                self._follow(tracker, message)

    def _follow(self, tracker: TagTracker, message: RankCheck | RankStep) -> None:
        """Run one of rank 0's integrity messages on this rank (past 0), its pool and its `tracker`."""
        tracker.mirror_tags(message.tags.pages, message.tags.tags)
        if message.tags.restamps:
            tracker.restamp(*(list(column) for column in zip(*message.tags.restamps, strict=True)))
        batch = self.batch_of(message.inputs)
        if isinstance(message, RankCheck):
            step = message.step
            self.tp.gather(tracker.check_pages(batch, step.expected, step.sealed).on_host())
            return
        write_tags = torch.tensor(message.write_tags, dtype=torch.int64).to(tracker.device)
        stamps = message.slot_stamps
        slot_stamps = None if stamps is None else torch.tensor(stamps, dtype=torch.int64).to(tracker.device)
        guard = WriteGuard(tracker.page_tags, write_tags)
        self.forward(replace(batch, write_guard=guard, slot_stamps=slot_stamps))
        tracker.hash_pages(message.sealed)

    def run(self, seqs: list[Request], is_prefill: bool) -> ForwardOutput:
        """Logits `[B, V]` of each sequence's next token (the lm_head's dtype), and prompt scores."""
        return self.forward(self.prepare(seqs, is_prefill))

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Logits `[B, V]` of a prepared batch. With --kv-integrity on, `Engine` checks this very batch
        (its block tables, lengths, positions and slot mapping, as the kernels will use them) between
        `prepare` and here, and its write guard, applied here on the device before the first layer
        stores, skips any write whose page moved on since (a batch run late). Under tensor parallelism
        rank 0 first sends the batch to the other ranks, which run it alongside (with --kv-integrity on,
        `rank_checks`' message: each rank guards its own writes, `integrity.ranks`)."""
        guard = batch.write_guard
        if guard is not None:
            slots = guard_slot_mapping(guard.page_tags, batch.slot_mapping, guard.write_tags, self.page_size)
            batch = replace(batch, slot_mapping=slots)
        if self.tp.size > 1 and self.tp.is_leader:
            checks = self.rank_checks
            self.tp.broadcast(batch.inputs if checks is None else checks.step_message(batch))
        return self.forward_local(batch)

    @torch.inference_mode()
    def forward_local(self, batch: ForwardBatch) -> ForwardOutput:
        """This rank's part of the forward (the model's collectives join the other ranks')."""
        kind = TARGET if batch.inputs is None else batch.inputs.kind
        if kind in (MTP_EXTEND, MTP_DRAFT):
            return self._forward_mtp(batch)
        hidden = None
        if not batch.is_prefill and self.decode_plans is not None:
            hidden = self.decode_plans.run(batch.input_ids, batch.positions, batch)
        if hidden is None:
            hidden = self.model.forward(batch.input_ids, batch.positions, batch)
        if self.mtp is not None:
            self.target_hidden = hidden  # what the MTP layer reads next (`MTP_EXTEND`)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        wanted = batch.inputs.prompt_logprobs if batch.inputs is not None else ()
        return ForwardOutput(logits, self._score_prompts(hidden, batch, wanted) if wanted else {})

    def _forward_mtp(self, batch: ForwardBatch) -> ForwardOutput:
        """The MTP layer over a batch: draft logits `[B, V]` of each sequence's last row, and that row's
        hidden state `[B, H]` (`ForwardOutput.hidden`: the next draft's input)."""
        inputs = batch.inputs
        assert self.mtp is not None and inputs is not None, "--speculative mtp loads the MTP layer"
        if inputs.kind == MTP_EXTEND:
            assert self.target_hidden is not None, "MTP_EXTEND follows a forward of the model"
            rows = torch.tensor(inputs.hidden_rows, dtype=torch.int64, device=self.target_hidden.device)
            previous = self.target_hidden[rows]
        else:
            assert inputs.previous_hidden is not None, "MTP_DRAFT carries its previous hidden states"
            previous = inputs.previous_hidden.to(self.device)
        hidden = self.mtp.forward(batch.input_ids, batch.positions, previous, batch)[batch.logits_indices]
        return ForwardOutput(self.mtp.compute_logits(hidden), hidden=hidden)

    def _score_prompts(
        self, hidden: torch.Tensor, batch: ForwardBatch, wanted: tuple[int, ...]
    ) -> dict[int, PromptScores]:
        """Each prompt that asked, prefilled whole: its rows of `hidden` `[T, H]` through the lm_head."""
        scores: dict[int, PromptScores] = {}
        start = 0
        for row, (num_top, query_len) in enumerate(zip(wanted, batch.query_lens, strict=True)):
            if num_top >= 0:
                rows = slice(start, start + query_len)
                vocab_size = self.model.config.vocab_size
                compute = self.model.compute_logits
                scores[row] = score_prompt(compute, hidden[rows], batch.input_ids[rows], num_top, vocab_size)
            start += query_len
        return scores
