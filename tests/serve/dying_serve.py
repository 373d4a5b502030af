"""`python -m tests.serve.dying_serve ARGS`: `kvq serve ARGS` whose engine thread dies (an error outside any
request's step) when a request with prompt ids [7, 7, 7] arrives: what a real engine bug would do."""

from __future__ import annotations

import sys

from kvq.runtime.engine import Engine

KILLER_PROMPT = [7, 7, 7]


class EngineThreadKilled(BaseException):
    """Not an `Exception`: nothing on the engine thread catches it."""


def dying_step(self: Engine, step=Engine.step):
    if any(seq.token_ids == KILLER_PROMPT for seq in self.scheduler.waiting):
        raise EngineThreadKilled("the test killed the engine thread")
    return step(self)


if __name__ == "__main__":
    Engine.step = dying_step  # type: ignore[method-assign]
    sys.argv = ["kvq", "serve", *sys.argv[1:]]
    from kvq.entry import main

    main()
