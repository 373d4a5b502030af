"""The engine: load a checkpoint, accept requests, run scheduler steps, turn tokens into text.

`Engine.generate(prompts, params)` runs requests to completion; `add_request` + `step` is the streaming
API (each step returns what changed; `completions`). With `kv_integrity` on, each step's batch is checked
before the model reads a page (`run_checked`), and a request whose pages fail ends alone with finish reason
"error". So does a request whose own output handling fails (its sampling, a token hook, its text, stop
strings, logprobs): the error is logged and names the request; the others in the step go on. With
`--speculative mtp` a decode step is `spec_step.SpecStep.run` (draft, verify, accept, roll back), through
the methods it names. Imports torch, transformers (the tokenizer) and kvq.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import replace

from transformers import AutoTokenizer

from kvq.errors import KvqError
from kvq.runtime import completions
from kvq.runtime.block_manager import BlockManager
from kvq.runtime.completions import Prompt
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine_stats import EngineStats
from kvq.runtime.integrity import make_tracker
from kvq.runtime.integrity.abort import remove_hit
from kvq.runtime.integrity.ranks import RankLeader, RankReset
from kvq.runtime.model_load import weight_bytes
from kvq.runtime.model_runner import ForwardOutput, ModelRunner
from kvq.runtime.outputs import OutputProcessor, RequestOutput, TokenHook
from kvq.runtime.prompt_encoding import encode_chat, encode_messages, encode_text, eos_token_ids
from kvq.runtime.request import Request, Status
from kvq.runtime.request_checks import check_request
from kvq.runtime.sampling import SamplingParams, make_generator, sample_requests
from kvq.runtime.scheduler import Scheduler
from kvq.runtime.spec_decode import Drafts, MtpProposer
from kvq.runtime.spec_step import SpecStep

__all__ = ["Engine", "EngineStats", "Prompt", "TokenHook"]


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)  # this rank's model and KV pool (tensor parallelism: its shard)
        if not self.runner.tp.is_leader:
            raise KvqError(
                f"an Engine runs on rank 0 only, this is rank {self.runner.tp.rank}: ranks past 0 run "
                "ModelRunner.loop() (kvq.runtime.distributed.worker.follow_under_launcher)"
            )
        loaded = self.runner.loaded
        self.ckpt, self.text_model, self.kv_spec = loaded.ckpt, loaded.text_model, loaded.kv_spec
        self.model, self.tp, self.kv_pool = loaded.model, loaded.tp, self.runner.kv_pool
        self.max_model_len = loaded.max_model_len
        self.rank_read_bytes, self.rank_weight_bytes = loaded.rank_read_bytes, loaded.rank_weight_bytes
        self.tokenizer = AutoTokenizer.from_pretrained(self.ckpt.root)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.ckpt.root, self.text_model.fields)
        self._new_kv_bookkeeping()
        self._ids = itertools.count()
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.token_hooks: list[TokenHook] = self.outputs.token_hooks  # the outputs' logprobs first
        self.stats = EngineStats()
        # --speculative mtp: the MTP layer drafts, each decode step verifies (`spec_step`)
        self.spec = (
            None if config.speculative is None else SpecStep(self.runner, config.num_speculative_tokens)
        )

    @property
    def proposer(self) -> MtpProposer | None:
        """The MTP drafter of `--speculative mtp` (its `stats`), or None."""
        return None if self.spec is None else self.spec.proposer

    def reset_kv(self, kv_integrity: str | None = None) -> None:
        """A fresh page allocator, prefix cache, scheduler and tracker (in `kv_integrity` mode if given)
        over the same pool memory and weights. Only with no request in flight."""
        if self.scheduler.has_unfinished:
            raise KvqError("reset_kv() with requests in flight; finish or abort them first")
        if kv_integrity is not None:
            self.config = replace(self.config, kv_integrity=kv_integrity)
        if self.tp.size > 1 and self.tp.is_leader:
            self.tp.broadcast(RankReset(self.config.kv_integrity))  # every rank's pool starts over
        self._new_kv_bookkeeping()

    def _new_kv_bookkeeping(self) -> None:
        config = self.config
        # None when "off"; the MTP layer's rows, after the model's, are not checked (they only shape drafts)
        num_layers = len(self.model.attention_layers())
        self.tracker = make_tracker(config.kv_integrity, self.kv_pool, num_layers)
        # at --tp N rank 0 has the other ranks check their own pools too (`integrity.ranks`)
        self.rank_checks: RankLeader | None = None
        if self.tracker is not None and self.tp.size > 1 and self.tp.is_leader:
            self.rank_checks = RankLeader(self.tp, self.tracker)
        self.block_manager = BlockManager(
            self.kv_pool.num_pages, config.page_size, config.enable_prefix_caching, self.tracker
        )
        self.scheduler = Scheduler.of(self.block_manager, config)
        self.runner.rank_checks = self.rank_checks

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (a no-op at --tp 1); the engine runs no more steps."""
        self.tp.close()

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight tensor the model keeps resident."""
        return weight_bytes(self.model)

    # -- requests -------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)

    def encode_chat(self, prompt: str) -> list[int]:
        """`prompt` as one user turn through the tokenizer's chat template (plain encoding without one)."""
        return encode_chat(self.tokenizer, prompt, str(self.ckpt.root))

    def encode_messages(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation through the chat template (`kvq.runtime.prompt_encoding.encode_messages`)."""
        return encode_messages(self.tokenizer, messages, str(self.ckpt.root))

    def make_sequence(self, prompt: Prompt, params: SamplingParams) -> Request:
        """Validate one request (`request_checks`: raises `KvqError`) and make its sequence, unqueued."""
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab_size = self.model.config.vocab_size
        max_len = check_request(token_ids, params, vocab_size, self.max_model_len, self.block_manager)
        seq = Request(next(self._ids), token_ids, len(token_ids), params, max_len, make_generator(params))
        seq.needs_prompt_logprobs = params.prompt_logprobs is not None
        return seq

    def add_request(self, prompt: Prompt, params: SamplingParams) -> int:
        """Queue one request (validated first); its id names its outputs."""
        seq = self.make_sequence(prompt, params)
        self.queue(seq)
        return seq.seq_id

    def queue(self, seq: Request) -> None:
        """Queue a request made by `make_sequence`, whose tokens become text (scored sequences are queued
        without)."""
        self.outputs.add(seq)
        self.scheduler.add(seq)

    def abort(self, request_id: int) -> bool:
        """Stop a queued or running request now (its client went away) and free its pages; False if the
        request is unknown or already finished. Call between steps."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            seq.finish_reason = "abort"
            self.outputs.forget(request_id)
            if self.spec is not None:
                self.spec.forget(request_id)
        return seq is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # -- running --------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; outputs of the requests it advanced (finished ones are forgotten)."""
        start = time.perf_counter()
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return []
        self.stats.largest_batch = max(self.stats.largest_batch, len(seqs))
        self.stats.num_steps += 1
        outputs = self._run(seqs, is_prefill)
        self.stats.step_seconds += time.perf_counter() - start
        return outputs

    def _run(self, seqs: list[Request], is_prefill: bool) -> list[RequestOutput]:
        if self.spec is not None and not is_prefill:
            return self.spec.run(self, seqs)
        outputs: list[RequestOutput] = []
        if self.tracker is None:
            result = self.timed_forward(lambda: self.runner.run(seqs, is_prefill))
        else:
            seqs, checked, outputs = self.run_checked(seqs, is_prefill)
            if checked is None:  # every request of the step was stopped
                return outputs
            result = checked
        self.outputs.keep_prompt_scores(seqs, result.prompt_scores)
        starts = [s.num_cached_tokens for s in seqs]  # the rows of this prefill, before tokens are added
        rows = [0, *itertools.accumulate(s.num_tokens - start for s, start in zip(seqs, starts, strict=True))]
        logits = result.logits
        token_ids, errors = sample_requests(seqs, logits, self.eos_token_ids)
        self.outputs.run_token_hooks(seqs, logits, token_ids, errors)
        for seq, token_id, error in zip(seqs, token_ids, errors, strict=True):
            if seq.status is Status.FINISHED:  # aborted during the step (by a token hook): already gone
                continue
            self.outputs.append_token(seq, token_id, error)
            if seq.finish_reason is not None:
                self._finish(seq)
            outputs.append(self.outputs.output(seq))
        if self.spec is not None:  # the MTP layer over the prompts: each request's first draft
            self.spec.extend(self, seqs, starts, rows[:-1])
        return outputs

    def _finish(self, seq: Request) -> None:
        self.scheduler.finish(seq)
        if self.spec is not None:
            self.spec.forget(seq.seq_id)

    def timed_forward(self, forward: Callable[[], ForwardOutput]) -> ForwardOutput:
        start = time.perf_counter()
        result = forward()
        self.stats.forward_seconds += time.perf_counter() - start
        return result

    def generate(
        self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams]
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order (`completions.generate`)."""
        return completions.generate(self, prompts, params)

    def stream(self, prompt: Prompt, params: SamplingParams) -> Iterator[RequestOutput]:
        """One request, output by output (`completions.stream`)."""
        return completions.stream(self, prompt, params)

    def run_checked(
        self, seqs: list[Request], is_prefill: bool, drafts: Drafts | None = None
    ) -> tuple[list[Request], ForwardOutput | None, list[RequestOutput]]:
        """Check the step's requests (their state before the batch is made, then the batch itself), stop
        the ones hit, run the rest: (seqs run, logits, outputs of the stopped ones). Rechecked after each
        removal, as the batch is rebuilt. Nothing the tracker finds is raised: it stops requests. With
        `drafts` (a speculative step's, row by row of `seqs`) the batch is their verification."""
        tracker, spec = self.tracker, self.spec
        assert tracker is not None
        stopped: list[Request] = []
        row_of = {seq.seq_id: b for b, seq in enumerate(seqs)}
        while seqs:
            kept, num_drafts = None, None
            if drafts is not None:
                kept = drafts.of([row_of[seq.seq_id] for seq in seqs])
                num_drafts = [len(tokens) for tokens in kept.token_ids]
            mismatches = tracker.screen(seqs, num_drafts)
            if not mismatches:
                if kept is None:
                    batch = self.runner.prepare(seqs, is_prefill)
                else:
                    assert spec is not None
                    batch = self.runner.batch_of(spec.proposer.verify_inputs(seqs, kept))
                mismatches = tracker.check(seqs, batch, num_drafts)
                if not mismatches and self.rank_checks is not None:
                    mismatches = self.rank_checks.check(seqs, batch)
                if not mismatches:
                    break
            seqs, hit = remove_hit(mismatches, seqs, self.scheduler, tracker)
            stopped += hit
            self.stats.integrity_aborts += len(hit)
        result = None
        if seqs:
            guarded = tracker.guard(batch)
            result = self.timed_forward(lambda: self.runner.forward(guarded))
        tracker.after_step(is_forward_run=bool(seqs))
        return seqs, result, [self.outputs.output(s) for s in stopped]
