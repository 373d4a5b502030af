"""CPU decode from `DecodePlan`s (`kvq.runtime.decode_plan`): the eager forward's logits bit for bit on every
CPU path, INT4 and BF16 weights, BF16 and FP8 pages; plans made once per batch size and remade when a batch
outgrows the buffers; the models and settings that keep decode eager; `--enforce-eager`."""

from __future__ import annotations

import logging

import pytest
import torch

from kvq.runtime.config import EngineConfig
from kvq.runtime.decode_plan import DecodePlan, linear_call, model_blocker
from kvq.runtime.engine import Engine
from kvq.runtime.kernels import CPU_ISA_ENV, CpuOps
from kvq.runtime.kernels.cpu.w4a8 import w4a8_path
from kvq.runtime.kernels.w4a16 import LAYOUT_W4A8_CPU
from kvq.runtime.layers.linear import DenseLinear
from kvq.runtime.layers.moe import Int4Experts
from kvq.runtime.model_load import make_kv_pool
from kvq.runtime.sampling import SamplingParams
from tests.runtime.reference import batch_teacher_forced_logits
from tests.test_cli_errors import run_kvq

# 3 sequences of different lengths; 4-token pages, so that decode crosses pages and the block tables grow
# past the buffers' first 16 columns (the plans are remade)
PROMPTS = [[5, 17, 3, 99, 42, 7, 7, 256], [9, 8, 7], [100 + i for i in range(30)]]


def _engines(path: str, **settings) -> tuple[Engine, Engine]:
    common = {"model": path, "kv_memory": "4MiB", "page_size": 4, **settings}
    return Engine(EngineConfig(**common)), Engine(EngineConfig(**common, enforce_eager=True))


def _forced(num_steps: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 1000, (len(PROMPTS), num_steps), generator=g).tolist()


def test_plans_give_the_eager_logits_on_every_cpu_path(int4_checkpoint, cpu_isa: str) -> None:
    planned, eager = _engines(str(int4_checkpoint("llama")))
    assert eager.runner.decode_plans is None
    forced = _forced(40)  # 30 + 40 tokens: 18 pages of the longest sequence
    found = batch_teacher_forced_logits(planned, PROMPTS, forced)
    assert torch.equal(found, batch_teacher_forced_logits(eager, PROMPTS, forced))
    plans = planned.runner.decode_plans
    if cpu_isa == "torch":  # every CPU op in torch: nothing to replay
        assert plans.blocker == "the C small ops are off" and not plans.plans
    else:
        assert plans.blocker is None and list(plans.plans) == [3] and plans.buffers.pages == 32


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("arch", ["llama", "glm4_moe"])
def test_plans_give_the_eager_logits_for_each_weight_and_page_kind(
    int4_checkpoint, tiny_checkpoint, arch: str, fmt: str, kv_cache_dtype: str
) -> None:
    """glm4_moe: q/k/v bias (its Linears join through themselves), partial rotary, MoE layers after a dense
    one (the MoE through its own call into the buffer)."""
    path = str(int4_checkpoint(arch) if fmt == "int4" else tiny_checkpoint(arch, "bf16"))
    planned, eager = _engines(path, kv_cache_dtype=kv_cache_dtype)
    forced = _forced(6)
    found = batch_teacher_forced_logits(planned, PROMPTS, forced)
    assert torch.equal(found, batch_teacher_forced_logits(eager, PROMPTS, forced))
    assert planned.runner.decode_plans.blocker is None


def test_plans_give_the_eager_logits_on_smollm2(smollm2_int4) -> None:
    """SmolLM2's shapes: 9 query / 3 KV heads, K = 576 (half a block of 128 past the last whole one), the
    tied lm_head; then whole requests through the checked pool (`kv_integrity="tags"`: the engine's write
    guard rewrites each step's slots before the plan copies them)."""
    planned, eager = _engines(str(smollm2_int4), kv_memory="16MiB")
    prompts = [planned.encode_chat(text) for text in ("What is the capital of France?", "Name three colors.")]
    forced = [[504, 3575, 314, 4649], [1978, 30, 2689, 28]]
    found = batch_teacher_forced_logits(planned, prompts, forced)
    assert torch.equal(found, batch_teacher_forced_logits(eager, prompts, forced))
    assert list(planned.runner.decode_plans.plans) == [2]
    planned, eager = _engines(str(smollm2_int4), kv_memory="16MiB", kv_integrity="tags")
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    outs, expected = planned.generate(prompts, params), eager.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert [o.logprobs for o in outs] == [o.logprobs for o in expected]
    assert all(o.error is None for o in outs) and planned.runner.decode_plans.blocker is None


def test_plans_are_made_once_per_batch_size_and_kept(int4_checkpoint) -> None:
    """Requests of different lengths: the batch shrinks 3 -> 2 -> 1; each size's plan is made at its first
    step and kept across generate calls; the greedy tokens are the eager engine's."""
    planned, eager = _engines(str(int4_checkpoint("llama")))
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (5, 9, 13)]
    outs = [o.token_ids for o in planned.generate(PROMPTS, params)]
    assert outs == [o.token_ids for o in eager.generate(PROMPTS, params)]
    plans = planned.runner.decode_plans
    assert sorted(plans.plans) == [1, 2, 3]
    kept = dict(plans.plans)
    planned.generate(PROMPTS, params)
    assert all(plans.plans[n] is kept[n] for n in kept)
    assert all(isinstance(p, DecodePlan) for p in kept.values())


def test_the_torch_path_decodes_eagerly_and_the_environment_is_read_once(
    int4_checkpoint, monkeypatch
) -> None:
    """--cpu-isa torch turns the C ops, and so the plans, off; $KVQ_CPU_ISA changed after load changes
    neither the plans nor the tokens (the path is chosen once)."""
    planned, _ = _engines(str(int4_checkpoint("llama")))
    in_torch = Engine(EngineConfig(model=str(int4_checkpoint("llama")), kv_memory="4MiB", cpu_isa="torch"))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first = planned.generate(PROMPTS[:1], params)[0].token_ids
    plans = planned.runner.decode_plans
    assert plans.blocker is None and list(plans.plans) == [1]
    monkeypatch.setenv(CPU_ISA_ENV, "torch")
    assert planned.generate(PROMPTS[:1], params)[0].token_ids == first
    assert plans.blocker is None and list(plans.plans) == [1]
    in_torch.generate(PROMPTS[:1], params)
    assert in_torch.runner.decode_plans.blocker == "the C small ops are off"


def test_new_kv_caches_remake_the_plans(int4_checkpoint) -> None:
    """Rebinding the layers' caches (a new pool, zeroed; no prefix cache to point into the old one) drops
    the plans bound to the old pages' addresses."""
    planned, eager = _engines(str(int4_checkpoint("llama")), enable_prefix_caching=False)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    planned.generate(PROMPTS, params)
    plans = planned.runner.decode_plans
    old = plans.plans[3]
    old_pool = planned.kv_pool
    planned.kv_pool = make_kv_pool(planned.config, planned.runner.loaded)  # every layer bound to new pages
    assert planned.kv_pool.zero_page == old_pool.zero_page
    outs = planned.generate(PROMPTS, params)
    assert plans.plans[3] is not old
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager.generate(PROMPTS, params)]


def test_models_no_plan_can_run_decode_eagerly(tiny_checkpoint, int4_checkpoint, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="kvq"):
        llama = str(int4_checkpoint("llama"))
        mla = Engine(EngineConfig(model=str(tiny_checkpoint("deepseek_v3", "bf16")), kv_memory="4MiB"))
        eager = Engine(EngineConfig(model=llama, kv_memory="4MiB", enforce_eager=True))
        Engine(EngineConfig(model=llama, kv_memory="4MiB"))
    assert [r.getMessage() for r in caplog.records if "CPU decode steps" in r.getMessage()] == [
        "CPU decode steps: eager (a layer other than Llama's)",
        "CPU decode steps: eager (--enforce-eager)",
        "CPU decode steps: plans (each layer's C calls bound once per batch size)",
    ]
    assert mla.runner.decode_plans is None and eager.runner.decode_plans is None
    ref = Engine(EngineConfig(model=str(int4_checkpoint("llama")), kv_memory="4MiB", dtype="float32"))
    assert ref.runner.decode_plans is None and model_blocker(ref.model) == "not bf16 on CPU"


def test_a_linear_without_a_c_call_runs_itself_into_the_buffer() -> None:
    """A bias (or torch's GEMM) has no single C call: the plan's entry is the Linear itself, copied."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(24, 64, generator=g).bfloat16(), torch.randn(24, generator=g).bfloat16()
    linear = DenseLinear(weight, bias, CpuOps.choose())
    x, y = torch.randn(3, 64, generator=g).bfloat16(), torch.empty(3, 24, dtype=torch.bfloat16)
    assert linear.call(x, y) is None
    fn, args = linear_call(linear, x, y)
    fn(*args)
    assert torch.equal(y, linear(x))


def test_enforce_eager_flag(tiny_checkpoint) -> None:
    path = str(tiny_checkpoint("llama", "bf16"))
    texts = [
        run_kvq("generate", path, "hi", "--max-tokens", "6", *flag) for flag in ([], ["--enforce-eager"])
    ]
    assert all(r.returncode == 0 for r in texts), [r.stderr for r in texts]
    assert texts[0].stdout == texts[1].stdout and texts[0].stdout.strip()


@pytest.mark.skipif(w4a8_path() is None, reason="int4_compute w4a8 needs AVX2 and kvq's CPU extension")
def test_w4a8_with_stacked_experts_plans_eager_and_w4a16(int4_checkpoint) -> None:
    """glm4_moe under int4_compute "w4a8": its stacked INT4 experts in the W4A8 layout too; plans give the
    eager logits; the logits stay within int8 rounding of W4A16's."""
    path = str(int4_checkpoint("glm4_moe"))
    planned, eager = _engines(path, int4_compute="w4a8")
    moe = [
        layer.mlp
        for layer in planned.model.layers
        if isinstance(getattr(layer.mlp, "experts", None), Int4Experts)
    ]
    assert moe and all(m.experts.w13.layout == m.experts.w2.layout == LAYOUT_W4A8_CPU for m in moe)
    forced = _forced(6)
    found = batch_teacher_forced_logits(planned, PROMPTS, forced)
    assert torch.equal(found, batch_teacher_forced_logits(eager, PROMPTS, forced))
    w4a16, _ = _engines(path)
    expected = batch_teacher_forced_logits(w4a16, PROMPTS, forced)
    assert (found - expected).norm() / expected.norm() < 0.08  # a tiny random model: 3.7% here
