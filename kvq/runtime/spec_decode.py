"""`--speculative mtp`: draft tokens with the checkpoint's MTP layer, verify them in one forward of the model.

The MTP layer's latent pages are one more layer of the KV pool, written at the same slots as the model's.
Positions below a request's last token hold final K/V in every layer: after each forward of the model
(a prefill, or a verification) the MTP layer runs over the positions that forward made final (`extend`:
at position i the token at i + 1 and the model's hidden state at i), which also gives the request's first
draft. A decode step then (`draft`) takes that draft and runs the MTP layer k - 1 more times, one
position each, on its own hidden states (those slots are rewritten by the next `extend`), and verifies
last token + k drafts in one forward (`verify`: logits of every row). The engine accepts
(`spec_accept`), appends, and gives back the pages past the accepted tokens (`BlockManager.truncate`).
Under tensor parallelism every forward here goes through `ModelRunner.forward`, so the ranks run it too.
Imports torch and kvq.runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvq.runtime.batch import MTP_DRAFT, MTP_EXTEND, VERIFY, ForwardBatch, StepInputs
from kvq.runtime.model_runner import ForwardOutput, ModelRunner
from kvq.runtime.request import Request
from kvq.runtime.spec_accept import draft_token

Forward = Callable[[ForwardBatch], ForwardOutput]  # the runner's, or the engine's checked one


@dataclass
class DraftState:
    """A request's next draft: the MTP layer's logits `[V]` for it and the hidden state `[H]` it came from."""

    logits: torch.Tensor
    hidden: torch.Tensor


@dataclass
class SpecStats:
    """Counters as vLLM's spec_decode metrics: verified requests-steps that drafted, draft tokens, accepted
    ones, and accepted ones by draft position; and the decode steps' wall time in the MTP layer (drafting
    and extending) and in verification (the model's forward over K + 1 positions)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    mtp_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verified request-step: accepted drafts plus the model's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def add(self, num_drafted: int, num_accepted: int) -> None:
        if not num_drafted:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos += [0] * (num_drafted - len(self.accepted_per_pos))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1


@dataclass
class Drafts:
    """A decode step's drafts, per request: the tokens and (sampling requests) each one's q `[V]`."""

    token_ids: list[list[int]]
    probs: list[list[torch.Tensor | None]]

    def of(self, rows: list[int]) -> Drafts:
        """The drafts of requests `rows` only (those a failed check left running)."""
        return Drafts([self.token_ids[b] for b in rows], [self.probs[b] for b in rows])


class MtpProposer:
    def __init__(self, runner: ModelRunner, num_speculative_tokens: int) -> None:
        self.runner, self.num_speculative_tokens = runner, num_speculative_tokens
        self.states: dict[int, DraftState] = {}  # by seq_id: requests whose first draft is known
        self.stats = SpecStats()

    def forget(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)

    def extend(self, seqs: list[Request], starts: list[int], rows: list[int], forward: Forward) -> None:
        """The MTP layer over positions `starts[b]` to the last but one of each request, whose hidden states
        the model's last forward has at rows `rows[b]` on; each request's next draft state from its last."""
        token_ids = [seq.token_ids[start + 1 :] for seq, start in zip(seqs, starts, strict=True)]
        hidden_rows = tuple(
            row + i for row, ids in zip(rows, token_ids, strict=True) for i in range(len(ids))
        )
        inputs = self.runner.span_inputs(
            seqs, starts, token_ids, True, kind=MTP_EXTEND, hidden_rows=hidden_rows
        )
        out = forward(self.runner.batch_of(inputs))
        assert out.hidden is not None
        for b, seq in enumerate(seqs):
            self.states[seq.seq_id] = DraftState(out.logits[b], out.hidden[b])

    def draft(self, seqs: list[Request], forward: Forward) -> Drafts:
        """Each request's drafts for this step (`Request.num_drafts`: up to num_speculative_tokens)."""
        counts = [seq.num_drafts(self.num_speculative_tokens) for seq in seqs]
        drafts = Drafts([[] for _ in seqs], [[] for _ in seqs])
        hidden: list[torch.Tensor | None] = [None] * len(seqs)
        logits: list[torch.Tensor | None] = [None] * len(seqs)
        for b, seq in enumerate(seqs):
            state = self.states[seq.seq_id]
            logits[b], hidden[b] = state.logits, state.hidden
        for step in range(max(counts, default=0)):
            active = [b for b, n in enumerate(counts) if n > step]
            for b in active:
                token, q = draft_token(logits[b], seqs[b].params, seqs[b].generator)  # type: ignore[arg-type]
                drafts.token_ids[b].append(token)
                drafts.probs[b].append(q)
            chained = [b for b in active if counts[b] > step + 1]
            if not chained:
                break
            out = forward(self.runner.batch_of(self._chain_inputs(seqs, chained, drafts, hidden)))
            assert out.hidden is not None
            for i, b in enumerate(chained):
                logits[b], hidden[b] = out.logits[i], out.hidden[i]
        return drafts

    def _chain_inputs(
        self, seqs: list[Request], chained: list[int], drafts: Drafts, hidden: list[torch.Tensor | None]
    ) -> StepInputs:
        """The MTP layer at the position before each request's newest draft, reading that draft."""
        batch_seqs = [seqs[b] for b in chained]
        starts = [seqs[b].num_tokens + len(drafts.token_ids[b]) - 2 for b in chained]
        previous = torch.stack([hidden[b] for b in chained]).cpu()  # type: ignore[misc]
        return self.runner.span_inputs(
            batch_seqs,
            starts,
            [[drafts.token_ids[b][-1]] for b in chained],
            False,
            kind=MTP_DRAFT,
            previous_hidden=previous,
        )

    def verify_inputs(self, seqs: list[Request], drafts: Drafts) -> StepInputs:
        """The model over each request's last token and its drafts: logits of every row."""
        starts = [seq.num_tokens - 1 for seq in seqs]
        token_ids = [[seq.token_ids[-1], *d] for seq, d in zip(seqs, drafts.token_ids, strict=True)]
        return self.runner.span_inputs(seqs, starts, token_ids, True, kind=VERIFY)
