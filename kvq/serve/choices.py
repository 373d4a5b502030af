"""A request's choices (its prompts times n), each an engine request: their first outputs, their final
ones, or all their outputs merged as they come; and a client that goes away ends them all.

Closing (`close`) aborts every choice not finished. Imports asyncio, starlette and kvq.runtime (types).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar

from starlette.requests import Request

from kvq.runtime.outputs import RequestOutput

T = TypeVar("T")
DISCONNECT_POLL_SECONDS = 0.25

Outputs = AsyncIterator[RequestOutput]


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


class Choices:
    def __init__(self, iterators: Sequence[Outputs]) -> None:
        self.iterators = list(iterators)
        self.firsts: list[RequestOutput] = []
        self.lasts: list[RequestOutput] = []  # each choice's latest output (its final one once drained)

    async def start(self) -> list[RequestOutput]:
        """Every choice's first output (by then the engine accepted it, or raised `KvqError`: a 400)."""
        self.firsts = [await it.__anext__() for it in self.iterators]
        self.lasts = list(self.firsts)
        return self.firsts

    async def finals(self) -> list[RequestOutput]:
        """Each choice's final output, its `logprobs` those of every token (outputs carry the new ones)."""
        self.lasts = [await _last(first, it) for first, it in zip(self.firsts, self.iterators, strict=True)]
        return self.lasts

    async def merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) for every output of every choice, firsts first, then as they come."""
        for index, first in enumerate(self.firsts):
            yield index, first
        if len(self.iterators) == 1:
            if not self.firsts[0].finished:
                async for out in self.iterators[0]:
                    self.lasts[0] = out
                    yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, it: Outputs) -> None:
            try:
                async for out in it:
                    await queue.put((index, out))
            except Exception as e:  # handed to the consumer, which re-raises it
                await queue.put((index, e))
                return
            await queue.put((index, None))

        pending = [i for i, first in enumerate(self.firsts) if not first.finished]
        tasks = [asyncio.ensure_future(pump(i, self.iterators[i])) for i in pending]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    self.lasts[index] = item
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Abort every choice still running (each iterator's close tells the engine)."""
        for it in self.iterators:
            with contextlib.suppress(RuntimeError):  # an iterator another task still runs
                await it.aclose()  # type: ignore[attr-defined]


async def _last(first: RequestOutput, it: Outputs) -> RequestOutput:
    """The final output, with every token's logprobs and the prompt's (which come with the first)."""
    last, logprobs = first, list(first.logprobs or [])
    while not last.finished:
        last = await it.__anext__()
        logprobs += last.logprobs or []
    return dataclasses.replace(
        last,
        logprobs=None if first.logprobs is None else logprobs,
        prompt_logprobs=first.prompt_logprobs,
    )


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`await work`, unless the client goes away first: then `work` is cancelled and `ClientGone` raised."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise ClientGone()
