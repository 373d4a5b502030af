"""The engine on CPU under each CPU path (--cpu-isa, else $KVQ_CPU_ISA): every INT4 Linear runs the chosen
path, the engine logs it once, all paths give the same greedy tokens on the tiny model, the choice is made
once at load (the setting over the environment), and a bad choice is a one-line user error."""

from __future__ import annotations

import logging

import pytest

from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.kernels import CPU_ISA_ENV, CpuOps, describe_cpu_path
from kvq.runtime.kernels.cpu.w4a8 import w4a8_path
from kvq.runtime.layers.linear import Int4Linear
from kvq.runtime.sampling import SamplingParams
from tests.runtime.cpu_isa import needs_amx
from tests.runtime.reference import batch_teacher_forced_logits
from tests.test_cli_errors import assert_one_line_error, run_kvq

PROMPT = [5, 17, 3, 99, 42, 7, 7, 256]


def test_every_int4_linear_runs_the_chosen_path(int4_checkpoint, cpu_isa: str, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="kvq"):
        engine = Engine(EngineConfig(model=str(int4_checkpoint("llama")), kv_memory="4MiB"))
    logged = [r.getMessage() for r in caplog.records if "CPU W4A16 path" in r.getMessage()]
    assert logged == [describe_cpu_path(CpuOps.choose(cpu_isa))]
    layer = engine.model.layers[0]
    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    assert all(isinstance(lin, Int4Linear) for lin in linears)
    assert {lin.weight.cpu_isa for lin in linears} == {None if cpu_isa == "torch" else cpu_isa}
    out = engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    reference = Engine(EngineConfig(model=str(int4_checkpoint("llama")), kv_memory="4MiB", dtype="float32"))
    expected = reference.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == expected.token_ids


@pytest.mark.skipif(w4a8_path() is None, reason="int4_compute w4a8 needs AVX2 and kvq's CPU extension")
def test_the_w4a8_kernel_is_logged_once(int4_checkpoint, caplog) -> None:
    config = EngineConfig(model=str(int4_checkpoint("llama")), kv_memory="4MiB", int4_compute="w4a8")
    with caplog.at_level(logging.INFO, logger="kvq"):
        Engine(config)
    logged = [r.getMessage() for r in caplog.records if "CPU W4A16 path" in r.getMessage()]
    assert logged == [describe_cpu_path(CpuOps.choose(), "w4a8")]
    assert f"INT4 as W4A8 (and an INT8 lm_head as W8A8) on the {w4a8_path()} kernel" in logged[0]


def test_a_bad_choice_is_one_line(tiny_checkpoint, monkeypatch) -> None:
    monkeypatch.setenv(CPU_ISA_ENV, "avx9")
    result = run_kvq("generate", str(tiny_checkpoint("llama", "bf16")), "hi", "--max-tokens", "2")
    assert_one_line_error(
        result, "$KVQ_CPU_ISA) is 'avx9'", "pick one of auto, amx, avx512bf16, avx512, avx2, scalar, torch"
    )


def test_a_bad_flag_is_one_line(tiny_checkpoint) -> None:
    path = str(tiny_checkpoint("llama", "bf16"))
    result = run_kvq("generate", path, "hi", "--max-tokens", "2", "--cpu-isa", "avx9")
    assert_one_line_error(result, "--cpu-isa", "avx9", "avx512bf16")


@pytest.mark.skipif(CpuOps.choose("auto").level is None, reason="kvq's C ops are not built")
def test_the_path_is_chosen_once_at_load(int4_checkpoint, monkeypatch) -> None:
    """EngineConfig.cpu_isa wins over $KVQ_CPU_ISA; the environment is read at load only: every layer, weight
    and KV cache holds the engine's `CpuOps` (a layer of C small ops: where they run, else None), and a later
    change of the variable changes nothing."""
    monkeypatch.setenv(CPU_ISA_ENV, "scalar")
    model = str(int4_checkpoint("llama"))
    in_torch = Engine(EngineConfig(model=model, kv_memory="4MiB", cpu_isa=" Torch"))
    from_env = Engine(EngineConfig(model=model, kv_memory="4MiB"))
    assert in_torch.config.cpu_isa == "torch" and in_torch.model.cpu_ops == CpuOps("torch", None)
    assert from_env.model.cpu_ops == CpuOps("scalar", 0)
    for engine in (in_torch, from_env):
        layer, ops = engine.model.layers[0], engine.model.cpu_ops
        small_ops = None if ops.level is None else ops  # the torch path: the norms hold none
        assert layer.input_layernorm.ops is small_ops and layer.self_attn.attn.kv.cpu_ops is ops
        assert layer.self_attn.qkv_proj.weight.cpu_isa == (None if ops.isa == "torch" else ops.isa)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    before = from_env.generate([PROMPT], params)[0].token_ids
    monkeypatch.setenv(CPU_ISA_ENV, "avx9")  # read at load only: no error now, the same path
    assert from_env.generate([PROMPT], params)[0].token_ids == before
    assert from_env.model.cpu_ops.level == 0


@needs_amx
@pytest.mark.parametrize("fmt", ["int4", "bf16"])
def test_amx_decode_batches_agree_with_the_reference(
    int4_checkpoint, tiny_checkpoint, fmt: str, monkeypatch
) -> None:
    """Six sequences decoded together on amx (the INT4 GEMM's AMX tiles; the dense BF16 Linears, the
    lm_head and a BF16 checkpoint's layers, on AMX tiles; 6 rows a step), teacher-forced along fp32
    reference mode's greedy tokens: logits within bf16 tolerances of the reference's, its picks agreed with
    but for near-ties."""
    monkeypatch.setenv(CPU_ISA_ENV, "amx")
    path = str(int4_checkpoint("llama") if fmt == "int4" else tiny_checkpoint("llama", "bf16"))
    prompts = [[5 + i, 17, 3 * i + 1, 99, 42, 7] for i in range(6)]
    reference = Engine(EngineConfig(model=path, kv_memory="4MiB", dtype="float32"))
    forced = [
        out.token_ids for out in reference.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    ]
    expected = batch_teacher_forced_logits(reference, prompts, forced)
    engine = Engine(EngineConfig(model=path, kv_memory="4MiB"))
    assert engine.model.lm_head.is_amx
    found = batch_teacher_forced_logits(engine, prompts, forced)
    scale = expected.abs().amax(-1, keepdim=True)
    assert ((found - expected).abs() <= 0.05 * scale).all()
    picks, best = found.argmax(-1), expected.argmax(-1)
    gaps = expected.amax(-1) - expected.gather(-1, picks[..., None])[..., 0]
    assert (picks == best).float().mean() >= 0.9 and (gaps < 0.02 * scale[..., 0]).all()
