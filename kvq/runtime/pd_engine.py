"""An engine that hands prefilled requests off and takes them in: the two halves of the prefill/decode split.

Prefill side: `add_prefill_request` queues a request to be prefilled here only; the forward of its prefill
step writes its prompt's K/V and, before its sampled token is used, its pages are exported
(`kv_transfer.export_handoff`); it then leaves this engine (pages freed, no output) and its handoff waits
in `take_handoffs()`. Decode side: `add_prefilled(handoff, params)` verifies the pages on arrival (tag and
digest of each: `kv_transfer.verify_handoff`, a `KvTransferError` for that request only) and queues the
request; at the start of a step, arrived requests that fit get pages from this pool through the block
manager (so prefix sharing and the checked pool's tags work as for a local prefill), their pages are
copied in, and that step's decode computes their last prompt token and samples their first token.
A request preempted later is recomputed from its tokens like any other.
Imports torch and kvq.runtime.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import cached_property

import torch

from kvq.errors import KvqError
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine, Prompt
from kvq.runtime.kv_transfer import (
    KVHandoff,
    KvTransferError,
    export_handoff,
    kv_identity,
    verify_handoff,
    write_pages,
)
from kvq.runtime.outputs import RequestOutput
from kvq.runtime.request import Request
from kvq.runtime.sampling import SamplingParams


class PDEngine(Engine):
    def __init__(self, config: EngineConfig) -> None:
        if config.tp > 1:  # a handoff holds this process's pool: one rank's share of the KV heads
            raise KvqError(
                f"the prefill/decode split runs at --tp 1 (got --tp {config.tp}): a handoff carries rank 0's "
                "KV pages only; drop --tp, or serve --role single at --tp N"
            )
        super().__init__(config)
        self._arrived: deque[tuple[Request, KVHandoff]] = deque()  # verified, waiting for pages
        self._to_hand_off: set[int] = set()  # queued here for their prefill only
        self._handoffs: dict[int, KVHandoff] = {}  # exported, not yet taken
        self.token_hooks.append(self._export_prefilled)

    @cached_property
    def kv_identity(self) -> dict[str, str]:
        """What a peer worker must agree on (`kv_transfer.kv_identity`)."""
        scales = [a.kv_scales for a in self.model.attention_layers()]
        model_type = str(self.text_model.fields.get("model_type"))
        pool = self.kv_pool
        return kv_identity(self.kv_spec, pool.layout, pool.page_size, scales, self.tokenizer, model_type)

    # -- prefill side ---------------------------------------------------------------------------------
    def add_prefill_request(self, prompt: Prompt, params: SamplingParams) -> int:
        """Queue a request to be prefilled here and handed off (`take_handoffs`)."""
        request_id = self.add_request(prompt, params)
        self.mark_for_hand_off(request_id)
        return request_id

    def mark_for_hand_off(self, request_id: int) -> None:
        self._to_hand_off.add(request_id)

    def take_handoffs(self) -> dict[int, KVHandoff]:
        """Requests prefilled since the last call, by request id, ready to send."""
        handoffs, self._handoffs = self._handoffs, {}
        return handoffs

    def _export_prefilled(self, seqs: list[Request], logits: torch.Tensor, token_ids: list[int]) -> None:
        """A token hook: right after the prefill forward, export the pages of requests to hand off."""
        for seq in seqs:
            if seq.seq_id in self._to_hand_off and seq.num_tokens == seq.num_prompt_tokens:
                writers = self._writers(seq)
                pages = export_handoff(
                    self.kv_pool, seq.token_ids, seq.block_table, self.kv_identity, writers
                )
                self._handoffs[seq.seq_id] = pages

    def _release_handed_off(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Outputs without those of requests just handed off, which leave this engine (pages freed)."""
        kept = []
        for out in outputs:
            if out.request_id not in self._handoffs or out.finish_reason == "error":
                self._handoffs.pop(out.request_id, None)
                kept.append(out)
            elif not out.finished:
                Engine.abort(self, out.request_id)  # frees its pages here (not a subclass's abort)
            self._to_hand_off.discard(out.request_id)
        return kept

    # -- decode side ----------------------------------------------------------------------------------
    def add_prefilled(self, handoff: KVHandoff, params: SamplingParams) -> int:
        """Queue a request whose prompt K/V another engine computed; its pages are verified now
        (`KvTransferError` names the page: only this request is refused)."""
        seq = self.make_sequence(handoff.prompt_token_ids, params)
        verify_handoff(handoff, self.kv_identity, f"request {seq.seq_id}", self.kv_pool)
        self.outputs.add(seq)
        self._arrived.append((seq, handoff))
        return seq.seq_id

    def step(self) -> list[RequestOutput]:
        self._admit_arrived()
        return self._release_handed_off(super().step())

    def _admit_arrived(self) -> None:
        """Admit arrived requests in order while they fit, their pages copied in."""
        while self._arrived:
            seq, handoff = self._arrived[0]
            if not self.scheduler.admit_prefilled(seq, handoff.num_computed_tokens):
                return
            self._arrived.popleft()
            first = seq.num_cached_tokens // self.config.page_size  # earlier pages: prefix hits here
            write_pages(self.kv_pool, seq.block_table, handoff.pages, first, self._writers(seq))
            if self.tracker is not None:
                self.tracker.after_import()

    def _writers(self, seq: Request) -> list[int] | None:
        """The writer tag of each of the request's pages (its slots' stamps), with the checked pool on."""
        return None if self.tracker is None else list(self.tracker.expected_writers(seq))

    def abort(self, request_id: int) -> bool:
        for item in self._arrived:
            if item[0].seq_id == request_id:
                self._arrived.remove(item)
                self.outputs.forget(request_id)
                return True
        return super().abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._arrived) or super().has_unfinished_requests()


def generate_split(
    prefill: PDEngine,
    decode: PDEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    in_transit: Callable[[int, KVHandoff], None] | None = None,
) -> list[RequestOutput]:
    """Every prompt prefilled on `prefill` and decoded on `decode` in one process (outputs in prompt
    order); `in_transit(i, handoff)` sees prompt i's handoff between the two (tests corrupt pages there).
    A request whose handoff fails its check ends alone with finish reason "error"."""
    ids = [prefill.add_prefill_request(p, params) for p in prompts]
    final: dict[int, RequestOutput] = {}
    moved: dict[int, int] = {}  # decode request id -> prompt index
    while len(final) + len(moved) < len(prompts):
        for out in prefill.step():  # only requests that failed here
            final[ids.index(out.request_id)] = out
        for request_id, handoff in prefill.take_handoffs().items():
            i = ids.index(request_id)
            if in_transit is not None:
                in_transit(i, handoff)
            try:
                moved[decode.add_prefilled(handoff, params)] = i
            except KvTransferError as e:
                final[i] = failed_output(request_id, handoff.prompt_token_ids, str(e))
    while len(final) < len(prompts):
        for out in decode.step():
            if out.finished:
                final[moved[out.request_id]] = out
    return [final[i] for i in range(len(prompts))]


def failed_output(request_id: int, prompt_token_ids: list[int], error: str) -> RequestOutput:
    """The final output of a request that ended with `error` before any token."""
    return RequestOutput(request_id, prompt_token_ids, [], "", "", True, "error", error)
