"""An engine that hands prefilled requests off and takes them in: the two halves of the prefill/decode split.

Prefill side: a request runs its prefill step here as usual (its first token sampled); `hand_off(id)` then
exports its prompt pages (`kv_transfer.export_handoff`, with the sampler state of a seeded request) and
frees them here. Decode side: `add_prefilled(handoff, params)` verifies the pages on arrival (tag and
digest of each: `kv_transfer.verify_handoff`, a `KvTransferError` for that request only) and queues the
request; at the start of a step, arrived requests that fit get pages from this pool through the block
manager (so prefix sharing and the checked pool's tags work as for a local prefill), their pages are
copied in and their first token appended, and they decode with the running batch from that step on.
A request preempted later is recomputed from its tokens like any other.
Imports torch and kvq.runtime.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace
from functools import cached_property

from kvq.errors import KvqError
from kvq.runtime.config import EngineConfig
from kvq.runtime.detokenizer import CompletionText
from kvq.runtime.engine import Engine, RequestOutput
from kvq.runtime.kv_transfer import (
    KVHandoff,
    KvTransferError,
    export_handoff,
    kv_identity,
    verify_handoff,
    write_pages,
)
from kvq.runtime.sampling import SamplingParams
from kvq.runtime.sequence import Sequence


class PDEngine(Engine):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._arrived: deque[tuple[Sequence, KVHandoff]] = deque()  # verified, waiting for pages

    @cached_property
    def kv_identity(self) -> dict[str, str]:
        """What a peer worker must agree on (`kv_transfer.kv_identity`)."""
        scales = [a.kv_scales for a in self.model.attention_layers()]
        model_type = str(self.text_model.fields.get("model_type"))
        pool = self.kv_pool
        return kv_identity(self.kv_spec, pool.layout, pool.page_size, scales, self.tokenizer, model_type)

    # -- prefill side ---------------------------------------------------------------------------------
    def hand_off(self, request_id: int) -> KVHandoff:
        """Export a running request that has its first token (its prefill ran) and free it here."""
        seq = next((s for s in self.scheduler.running if s.seq_id == request_id), None)
        if seq is None or seq.num_tokens != seq.num_prompt_tokens + 1:
            raise KvqError(
                f"request {request_id} is not a running request just prefilled; nothing to hand off"
            )
        handoff = export_handoff(
            self.kv_pool, seq.token_ids, seq.num_prompt_tokens, seq.block_table, self.kv_identity
        )
        if seq.generator is not None:
            handoff.generator_state = seq.generator.get_state()
        self.scheduler.finish(seq)
        self._texts.pop(request_id, None)
        return handoff

    # -- decode side ----------------------------------------------------------------------------------
    def add_prefilled(self, handoff: KVHandoff, params: SamplingParams) -> int:
        """Queue a request whose prompt KV another engine computed; its pages are verified now
        (`KvTransferError` names the page: only this request is refused)."""
        seq = self.make_sequence(handoff.prompt_token_ids, params)
        verify_handoff(handoff, self.kv_identity, f"request {seq.seq_id}", self.kv_pool)
        if seq.generator is not None and handoff.generator_state is not None:
            seq.generator.set_state(handoff.generator_state)
        self._texts[seq.seq_id] = CompletionText(self.tokenizer, seq.params.stop)
        self._arrived.append((seq, handoff))
        return seq.seq_id

    def step(self) -> list[RequestOutput]:
        return self._admit_arrived() + super().step()

    def _admit_arrived(self) -> list[RequestOutput]:
        """Admit arrived requests in order while they fit; outputs of any their first token finished."""
        outputs: list[RequestOutput] = []
        while self._arrived and self.scheduler.admit_prefilled(self._arrived[0][0]):
            seq, handoff = self._arrived.popleft()
            write_pages(
                self.kv_pool, seq.block_table, handoff.pages, seq.num_cached_tokens // self.config.page_size
            )
            if self.tracker is not None:
                self.tracker.after_import()
            self._append(seq, handoff.first_token_id)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                outputs.append(self._output(seq))
        return outputs

    def abort(self, request_id: int) -> bool:
        for item in self._arrived:
            if item[0].seq_id == request_id:
                self._arrived.remove(item)
                self._texts.pop(request_id, None)
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
    ids = [prefill.add_request(p, params) for p in prompts]
    final: dict[int, RequestOutput] = {}
    moved: dict[int, int] = {}  # decode request id -> prompt index
    while len(final) + len(moved) < len(prompts):
        for out in prefill.step():
            i = ids.index(out.request_id)
            if out.finished:
                final[i] = out
                continue
            handoff = prefill.hand_off(out.request_id)
            if in_transit is not None:
                in_transit(i, handoff)
            try:
                moved[decode.add_prefilled(handoff, params)] = i
            except KvTransferError as e:
                final[i] = replace(out, finished=True, finish_reason="error", error=str(e), delta="")
    while len(final) < len(prompts):
        for out in decode.step():
            if out.finished:
                final[moved[out.request_id]] = out
    return [final[i] for i in range(len(prompts))]
