"""Requests run to the end over an engine's streaming API (`add_request` + `step`): every prompt to its
completion (`Engine.generate`), or one request output by output (`Engine.stream`).
Imports kvq.runtime; the engine only as `Steps`.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from typing import Protocol

from kvq.errors import KvqError
from kvq.runtime.frozen_heap import frozen_heap
from kvq.runtime.outputs import RequestOutput
from kvq.runtime.request import Request
from kvq.runtime.sampling_params import SamplingParams

Prompt = str | list[int]


class Steps(Protocol):
    """What running requests to the end uses of the engine (`kvq.runtime.engine.Engine`)."""

    def make_sequence(self, prompt: Prompt, params: SamplingParams) -> Request: ...
    def queue(self, seq: Request) -> None: ...
    def add_request(self, prompt: Prompt, params: SamplingParams) -> int: ...
    def step(self) -> list[RequestOutput]: ...


def generate(
    engine: Steps, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams]
) -> list[RequestOutput]:
    """Run every prompt to completion; outputs in prompt order. All prompts are validated first."""
    param_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(param_list) != len(prompts):
        raise KvqError(f"{len(prompts)} prompts but {len(param_list)} SamplingParams; pass one or one each")
    seqs = [engine.make_sequence(p, sp) for p, sp in zip(prompts, param_list, strict=True)]
    for seq in seqs:
        engine.queue(seq)
    final: dict[int, RequestOutput] = {}
    with frozen_heap():
        while len(final) < len(seqs):
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
    return [final[s.seq_id] for s in seqs]


def stream(engine: Steps, prompt: Prompt, params: SamplingParams) -> Iterator[RequestOutput]:
    """One request, output by output (other queued requests advance alongside)."""
    request_id = engine.add_request(prompt, params)
    while True:
        for out in engine.step():
            if out.request_id == request_id:
                yield out
                if out.finished:
                    return
