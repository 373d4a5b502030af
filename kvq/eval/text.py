"""Held-out text through two engines in lockstep: each window's NLL under both, KL(baseline || model) of every
next-token distribution and whether their top-1 tokens agree.

Both engines decode the same windows by teacher forcing (`kvq.runtime.scoring`), each with a token hook
that hands its logits row for (window, position) to a `LogitsPairing`; a row waits only until the other
engine produces the same (window, position), and the engine that is behind is the one stepped next, so
at most about one step's rows are held. Nothing is written to disk and nothing depends on both engines
scheduling alike (different pool sizes or preemption only change which side waits).
Imports torch and kvq.runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvq.runtime.request import Request
from kvq.runtime.scoring import TeacherForcing, check_finished, force

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from kvq.runtime.engine import Engine

REFERENCE, MODEL = 0, 1


@dataclass
class WindowScores:
    """Per window: the summed NLL of its predicted tokens under each side, and (with a reference) the
    summed KL(reference || model) and the number of positions whose argmax tokens agree."""

    num_predicted: int  # tokens predicted per window (its length - 1)
    nll: list[float]
    reference_nll: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    num_agree: list[int] = field(default_factory=list)


class LogitsPairing:
    """Token hooks for both sides; each (window, position) seen by both adds to that window's KL and
    agreement count, and is then dropped."""

    def __init__(self, num_windows: int) -> None:
        self.windows: tuple[dict[int, int], dict[int, int]] = ({}, {})  # side -> request id -> window
        self.pending: tuple[dict, dict] = ({}, {})  # side -> (window, position) -> logits row [V]
        self.kl = [0.0] * num_windows
        self.num_agree = [0] * num_windows
        self.num_paired = 0

    def hook(self, side: int) -> Callable[[list[Request], torch.Tensor, list[int]], None]:
        def record(seqs: list[Request], logits: torch.Tensor, _token_ids: list[int]) -> None:
            pairs: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (window, reference row, model row)
            for row, seq in enumerate(seqs):
                window = self.windows[side].get(seq.seq_id)
                if window is None:
                    continue
                key = (window, seq.num_tokens - seq.num_prompt_tokens)
                mine = logits[row].float().cpu()
                other = self.pending[1 - side].pop(key, None)
                if other is None:
                    self.pending[side][key] = mine
                else:
                    pairs.append((window, *((mine, other) if side == REFERENCE else (other, mine))))
            if pairs:
                self._add(pairs)

        return record

    def _add(self, pairs: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        reference = torch.log_softmax(torch.stack([p[1] for p in pairs]), dim=-1)  # [N, V]
        model = torch.log_softmax(torch.stack([p[2] for p in pairs]), dim=-1)
        kl = (reference.exp() * (reference - model)).sum(dim=-1).tolist()
        agree = (reference.argmax(dim=-1) == model.argmax(dim=-1)).tolist()
        for (window, _r, _m), kl_row, is_same in zip(pairs, kl, agree, strict=True):
            self.kl[window] += kl_row
            self.num_agree[window] += int(is_same)
        self.num_paired += len(pairs)


def score_windows(
    model: Engine,
    windows: Sequence[Sequence[int]],
    reference: Engine | None = None,
    on_tokens: Callable[[int], None] | None = None,
) -> WindowScores:
    """NLL of every window under `model` (and `reference`), with KL and agreement when both are given."""
    engines = [model] if reference is None else [reference, model]
    sides = [MODEL] if reference is None else [REFERENCE, MODEL]
    pairing = LogitsPairing(len(windows))
    forcings = [TeacherForcing() for _ in engines]
    seqs: list[list[Request]] = []
    for side, engine, forcing in zip(sides, engines, forcings, strict=True):
        queued = [force(engine, forcing, [w[0]], w[1:]) for w in windows]
        pairing.windows[side].update({s.seq_id: i for i, s in enumerate(queued)})
        seqs.append(queued)
    hooks = [pairing.hook(side) if reference is not None else None for side in sides]
    for engine, forcing, hook in zip(engines, forcings, hooks, strict=True):
        engine.token_hooks += [forcing] if hook is None else [forcing, hook]
    try:
        _step_until_done(engines, seqs, pairing, on_tokens)
    finally:
        for engine, forcing, hook in zip(engines, forcings, hooks, strict=True):
            engine.token_hooks.remove(forcing)
            if hook is not None:
                engine.token_hooks.remove(hook)
    for queued in seqs:
        check_finished(queued)
    assert not any(pairing.pending), "every (window, position) is seen by both engines"
    nll = [[forcing.nll[s.seq_id] for s in queued] for forcing, queued in zip(forcings, seqs, strict=True)]
    scores = WindowScores(len(windows[0]) - 1, nll[-1])
    if reference is not None:
        scores.reference_nll, scores.kl, scores.num_agree = nll[0], pairing.kl, pairing.num_agree
    return scores


def _step_until_done(
    engines: list[Engine],
    seqs: list[list[Request]],
    pairing: LogitsPairing,
    on_tokens: Callable[[int], None] | None,
) -> None:
    """Step the side that is behind (the one the other's unpaired rows wait for) until all finish."""

    def is_running(side: int) -> bool:
        return any(s.finish_reason is None for s in seqs[side])

    while any(is_running(side) for side in range(len(engines))):
        side = 0
        if len(engines) == 2:
            side = MODEL if len(pairing.pending[REFERENCE]) > len(pairing.pending[MODEL]) else REFERENCE
            if not is_running(side):
                side = 1 - side
        before = pairing.num_paired
        outputs = engines[side].step()
        if on_tokens is not None:
            on_tokens(pairing.num_paired - before if len(engines) == 2 else len(outputs))
