"""The engine on the Triton kernels (interpreted on CPU) gives the same greedy tokens as on the torch path.

`KVQ_KERNELS=triton` sends every kernel call to its Triton launcher; on CPU tensors the kernels run under
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), as in the other kernel tests. Spies
prove each expected launcher ran. FP8 pages use per-tensor scales measured on the prompts
(`tests/runtime/kv_scales.py`), as `kvq calibrate` would.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import kvq.runtime.kernels.triton.fused_moe as fused_moe_triton
import kvq.runtime.kernels.triton.kv_store as kv_store_triton
import kvq.runtime.kernels.triton.latent_attention as latent_attention_triton
import kvq.runtime.kernels.triton.paged_attention as paged_attention_triton
import kvq.runtime.kernels.triton.w4a16 as w4a16_triton
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.kernels import KVQ_KERNELS_ENV
from kvq.runtime.sampling_params import SamplingParams
from tests.runtime.kernels.kernel_cases import REL_TOL, assert_close_rel
from tests.runtime.kv_scales import measure_kv_scales, with_kv_scales
from tests.runtime.reference import engine_greedy, teacher_forced_logits

LAUNCHERS = (
    (kv_store_triton, "store_kv_triton"),
    (paged_attention_triton, "paged_decode_attention_triton"),
    (w4a16_triton, "w4a16_linear_triton"),
    (fused_moe_triton, "fused_moe_triton"),
    (latent_attention_triton, "latent_decode_attention_triton"),
)
GQA_LAUNCHERS = {name for _, name in LAUNCHERS} - {"latent_decode_attention_triton"}
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]  # page size 4: a full page, a partial one, shared decode steps
NUM_TOKENS = 4


def count_launches(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Wrap every Triton launcher so the returned counter tallies its calls by name."""
    calls: Counter = Counter()

    def counted(name: str, launch: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return launch(*args, **kwargs)

        return wrapper

    for module, name in LAUNCHERS:
        monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    return calls


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Engines here run on one torch thread (tiny ops; a busy second core stalls two-thread ops)."""
    num_threads = torch.get_num_threads()
    yield
    torch.set_num_threads(num_threads)


def make_engine(path: Path, dtype: str, kv_cache_dtype: str) -> Engine:
    config = EngineConfig(
        model=str(path), dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_memory="4MiB", page_size=4, threads=1
    )
    return Engine(config)


def forced_logits(engine: Engine, tokens: list[list[int]]) -> list[torch.Tensor]:
    """fp32 logits `[n, V]` of each prompt's n greedy steps along `tokens` (a prefill, then decode steps)."""
    return [teacher_forced_logits(engine, p, t[:-1]) for p, t in zip(PROMPTS, tokens, strict=True)]


def assert_same_choices(logits: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    """At every step, `logits`' greedy token is `expected`'s, or ties with it within `tolerance`."""
    chosen = expected.gather(1, logits.argmax(dim=1, keepdim=True))[:, 0]
    best = expected.max(dim=1).values
    assert (chosen >= best - tolerance).all(), (best - chosen).tolist()


# (checkpoint, engine dtype, KV pages, launchers that must run). float32 is the reference mode: weights
# dequantized to fp32, so only the KV kernels run, on fp32 queries, and the greedy tokens must be equal.
# bfloat16 runs the INT4 kernels too (their launchers compute in fp32 under the interpreter, whose bf16
# tl.dot is wrong) but rounds logits to bf16: a random tiny model's top two logits are often one bf16 step
# apart there, so a flip is a tie, not a bug; the steps are compared along the same tokens instead.
# glm4_moe's INT4 experts (fused MoE) and shared expert (W4A16 linear) cover both INT4 kernels. An MLA
# model's pages are the latent's: its store is the torch path's on every backend, its decode Triton's.
CASES = [
    ("llama-bf16", "float32", "fp8_e4m3", {"store_kv_triton", "paged_decode_attention_triton"}),
    ("glm4_moe-int4", "bfloat16", "fp8_e4m3", GQA_LAUNCHERS),
    ("glm_moe_dsa-bf16", "float32", "fp8_e4m3", {"latent_decode_attention_triton"}),
]


@pytest.mark.parametrize(("checkpoint", "dtype", "kv_cache_dtype", "launchers"), CASES)
def test_triton_kernels_give_the_torch_path_greedy_tokens(
    tiny_checkpoint,
    int4_checkpoint,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    one_thread: None,
    checkpoint: str,
    dtype: str,
    kv_cache_dtype: str,
    launchers: set[str],
) -> None:
    arch, fmt = checkpoint.split("-")
    source = int4_checkpoint(arch) if fmt == "int4" else tiny_checkpoint(arch, fmt)
    monkeypatch.setenv(KVQ_KERNELS_ENV, "torch")
    path = with_kv_scales(source, tmp_path / "model", measure_kv_scales(source, PROMPTS))
    engine = make_engine(path, dtype, kv_cache_dtype)
    expected_tokens = engine_greedy(engine, PROMPTS, NUM_TOKENS)
    expected_logits = forced_logits(engine, expected_tokens)
    monkeypatch.setenv(KVQ_KERNELS_ENV, "triton")
    calls = count_launches(monkeypatch)
    engine = make_engine(path, dtype, kv_cache_dtype)
    if dtype == "float32":
        assert engine_greedy(engine, PROMPTS, NUM_TOKENS) == expected_tokens
    rel = REL_TOL[getattr(torch, dtype)]
    for found, expected in zip(forced_logits(engine, expected_tokens), expected_logits, strict=True):
        assert_close_rel(found, expected, rel)
        assert_same_choices(found, expected, 2 * rel * expected.abs().max().item())
    assert set(calls) == launchers, calls


def test_a_checked_pool_on_triton_stamps_in_the_store_and_decodes_as_the_torch_path(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    """`--kv-integrity tags` with the Triton kernels (fp32, llama): the Triton store writes each slot's stamp
    (writer tag ^ position, every layer) in its own program, no step check stops a request, and the greedy
    tokens are the torch path's."""
    path = tiny_checkpoint("llama", "bf16")
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(KVQ_KERNELS_ENV, backend)
        config = EngineConfig(
            model=str(path), dtype="float32", kv_memory="4MiB", page_size=4, kv_integrity="tags"
        )
        engine = Engine(config)
        ids = [engine.add_request(p, params) for p in PROMPTS]
        engine.step()  # the prefill
        engine.step()  # a decode step
        stamps, tracker = engine.kv_pool.stamps, engine.tracker
        assert stamps is not None and tracker is not None
        running = engine.scheduler.running
        assert len(running) == len(PROMPTS)
        for seq in running:  # every slot written so far carries its writer's stamp, in every layer
            writers = tracker.expected_writers(seq)
            for position in range(seq.num_tokens - 1):
                page, offset = divmod(position, 4)
                assert (stamps[seq.block_table[page], offset] == (writers[page] ^ position)).all(), position
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
        assert all(outputs[i].finish_reason == "length" for i in ids)
        tokens[backend] = [outputs[i].token_ids for i in ids]
    assert tokens["triton"] == tokens["torch"]
