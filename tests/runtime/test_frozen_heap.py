"""`frozen_heap`: the heap frozen for a loop's length and unfrozen after (an exception included), a heap
the caller froze left frozen, and `Engine.generate` decoding inside it."""

from __future__ import annotations

import gc

import pytest

from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.frozen_heap import frozen_heap
from kvq.runtime.sampling import SamplingParams


def test_frozen_for_the_body_only() -> None:
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        with frozen_heap():  # nested: the outer one unfreezes
            pass
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("a failed step")
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_by_the_caller_stays_frozen() -> None:
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        with frozen_heap():
            pass
        # neither unfrozen (0) nor frozen again (more); a frozen object another thread frees lowers the count
        assert 0 < gc.get_freeze_count() <= count
    finally:
        gc.unfreeze()


def test_generate_decodes_in_a_frozen_heap(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(EngineConfig(model=str(tiny_checkpoint("llama", "bf16")), kv_memory="4MiB"))
    counts: list[int] = []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: counts.append(gc.get_freeze_count()) or step())
    engine.generate([[5, 17, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert counts and min(counts) > 0 and gc.get_freeze_count() == 0
