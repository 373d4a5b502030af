"""The engine's counters since it was made (`Engine.stats`): steps, batch sizes, wall time in steps and in
the model forward, requests stopped by a failed KV page check. Imports nothing of kvq.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Counters since the engine was made."""

    integrity_aborts: int = 0  # requests stopped by a failed KV page check
    largest_batch: int = 0  # most requests one step ran
    num_steps: int = 0  # steps that ran a batch
    step_seconds: float = 0.0  # wall time in those steps (host work + forward)
    forward_seconds: float = 0.0  # of which in the model forward (on CPU: its compute; CUDA: its launches)
