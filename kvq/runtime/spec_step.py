"""The engine's decode step with `--speculative mtp`: draft, verify in one forward, accept, roll back.

`SpecStep.run` is `Engine.step` for a decode batch when the engine speculates: the requests the integrity
screen passes draft (`MtpProposer.draft`), the model verifies last token + drafts in one forward (through
the engine's checked run with `--kv-integrity`), each request keeps what `spec_accept` accepts, the tokens
go through the token hooks and outputs (`OutputProcessor`) column by column, the pages past the accepted
tokens go back (`BlockManager.truncate`; the tracker confirms the accepted drafts' stamps) and the MTP
layer runs over what was accepted (the next drafts). Imports torch and kvq.runtime; the engine only as
`SpecHost`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from typing import Protocol

import torch

from kvq.runtime.block_manager import BlockManager
from kvq.runtime.integrity.abort import remove_hit
from kvq.runtime.integrity.tracker import TagTracker
from kvq.runtime.model_runner import ForwardOutput, ModelRunner
from kvq.runtime.outputs import OutputProcessor, RequestOutput, stop
from kvq.runtime.request import Request, Status
from kvq.runtime.scheduler import Scheduler
from kvq.runtime.spec_accept import Verdict, accept
from kvq.runtime.spec_decode import Drafts, Forward, MtpProposer

logger = logging.getLogger("kvq")


class AbortCount(Protocol):
    integrity_aborts: int


class SpecHost(Protocol):
    """What a speculative step uses of the engine (`kvq.runtime.engine.Engine`)."""

    @property
    def tracker(self) -> TagTracker | None: ...
    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def block_manager(self) -> BlockManager: ...
    @property
    def outputs(self) -> OutputProcessor: ...
    @property
    def stats(self) -> AbortCount: ...
    @property
    def eos_token_ids(self) -> Collection[int]: ...

    def run_checked(
        self, seqs: list[Request], is_prefill: bool, drafts: Drafts | None = None
    ) -> tuple[list[Request], ForwardOutput | None, list[RequestOutput]]: ...
    def timed_forward(self, forward: Callable[[], ForwardOutput]) -> ForwardOutput: ...


class SpecStep:
    def __init__(self, runner: ModelRunner, num_speculative_tokens: int) -> None:
        self.runner = runner
        self.proposer = MtpProposer(runner, num_speculative_tokens)

    def forget(self, seq_id: int) -> None:
        self.proposer.forget(seq_id)

    def extend(self, host: SpecHost, seqs: list[Request], starts: list[int], rows: list[int]) -> None:
        """The MTP layer over each running request's positions from `starts[b]` to its last but one, which
        the model's last forward computed from its row `rows[b]` on (`MtpProposer.extend`)."""
        kept = [b for b, seq in enumerate(seqs) if seq.status is Status.RUNNING]
        if kept:
            self.proposer.extend(
                [seqs[b] for b in kept],
                [starts[b] for b in kept],
                [rows[b] for b in kept],
                self._forward(host),
            )

    def run(self, host: SpecHost, seqs: list[Request]) -> list[RequestOutput]:
        """One decode step of the running `seqs`: the outputs of the requests it advanced or stopped."""
        proposer, stats = self.proposer, self.proposer.stats
        stopped: list[RequestOutput] = []
        if host.tracker is not None:  # requests already marked draft nothing
            seqs, stopped = self._screen(host, seqs)
        start = time.perf_counter()
        drafts = proposer.draft(seqs, self._forward(host))
        middle = time.perf_counter()
        if host.tracker is None:
            batch = self.runner.batch_of(proposer.verify_inputs(seqs, drafts))
            logits = host.timed_forward(lambda: self.runner.forward(batch)).logits  # [T, V]
        else:
            row_of = {seq.seq_id: b for b, seq in enumerate(seqs)}
            seqs, checked, outputs = host.run_checked(seqs, False, drafts)
            for out in outputs:
                proposer.forget(out.request_id)
            stopped += outputs
            if checked is None:
                return stopped
            drafts, logits = drafts.of([row_of[seq.seq_id] for seq in seqs]), checked.logits
        stats.verify_seconds += time.perf_counter() - middle
        num_tokens = [seq.num_tokens for seq in seqs]
        offsets, verdicts, row = [], [], 0
        for seq, tokens, probs in zip(seqs, drafts.token_ids, drafts.probs, strict=True):
            offsets.append(row)
            verdicts.append(self._accept(host, seq, logits[row : row + len(tokens) + 1], tokens, probs))
            row += len(tokens) + 1
        self._append_verdicts(host, seqs, logits, offsets, verdicts)
        for seq, tokens, verdict, n in zip(seqs, drafts.token_ids, verdicts, num_tokens, strict=True):
            stats.add(len(tokens), min(verdict.num_accepted, seq.num_tokens - n))
            if seq.finish_reason is not None:
                host.scheduler.finish(seq)
                proposer.forget(seq.seq_id)
                continue
            host.block_manager.truncate(seq)
            if host.tracker is not None:  # accepted drafts' slots: their stamps lose the draft mark
                host.tracker.confirm_drafts(seq, n, seq.num_tokens - 1)
        extend_start = time.perf_counter()
        self.extend(host, seqs, [n - 1 for n in num_tokens], offsets)
        stats.mtp_seconds += middle - start + time.perf_counter() - extend_start
        return stopped + [host.outputs.output(seq) for seq in seqs]

    def _forward(self, host: SpecHost) -> Forward:
        return lambda batch: host.timed_forward(lambda: self.runner.forward(batch))

    def _screen(self, host: SpecHost, seqs: list[Request]) -> tuple[list[Request], list[RequestOutput]]:
        """Stop the requests the tracker's host screen fails, before they draft."""
        assert host.tracker is not None
        num_drafts = [seq.num_drafts(self.proposer.num_speculative_tokens) for seq in seqs]
        mismatches = host.tracker.screen(seqs, num_drafts)
        if not mismatches:
            return seqs, []
        seqs, hit = remove_hit(mismatches, seqs, host.scheduler, host.tracker)
        host.stats.integrity_aborts += len(hit)
        for seq in hit:
            self.proposer.forget(seq.seq_id)
        return seqs, [host.outputs.output(seq) for seq in hit]

    @staticmethod
    def _accept(host: SpecHost, seq: Request, rows: torch.Tensor, tokens: list[int], probs: list) -> Verdict:
        try:
            return accept(seq, rows, tokens, probs, host.eos_token_ids)
        except Exception as e:  # one request's parameters: that request alone ends
            logger.exception("request %d: its speculative acceptance failed; it is stopped", seq.seq_id)
            return Verdict([], 0, f"output handling failed ({type(e).__name__}: {e})")

    @staticmethod
    def _append_verdicts(
        host: SpecHost, seqs: list[Request], logits: torch.Tensor, offsets: list[int], verdicts: list[Verdict]
    ) -> None:
        """Append each request's tokens, one column of the step at a time, through the token hooks (a hook
        that replaces a token ends that request's tokens of the step there) until it finishes."""
        for j in range(max(len(v.token_ids) for v in verdicts)):
            active = [
                b
                for b, v in enumerate(verdicts)
                if len(v.token_ids) > j
                and seqs[b].finish_reason is None
                and seqs[b].status is not Status.FINISHED
            ]
            if not active:
                break
            batch = [seqs[b] for b in active]
            token_ids = [verdicts[b].token_ids[j] for b in active]
            errors: list[str | None] = [None] * len(active)
            host.outputs.run_token_hooks(batch, logits[[offsets[b] + j for b in active]], token_ids, errors)
            for b, token_id, error in zip(active, token_ids, errors, strict=True):
                if token_id != verdicts[b].token_ids[j]:  # replaced: the drafts after it no longer follow
                    verdicts[b].token_ids[j + 1 :] = []
                host.outputs.append_token(seqs[b], token_id, error)
        for seq, verdict in zip(seqs, verdicts, strict=True):
            if verdict.error is not None and seq.finish_reason is None:
                stop(seq, verdict.error)
