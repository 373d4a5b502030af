"""Runtime test fixtures: `kvq compress` outputs (compressed-tensors W4A16 pack-quantized) of the tiny
checkpoints and of SmolLM2, and SmolLM2's with `kvq calibrate` KV scales, built once per session."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Imports of calibrate/compress (compressed-tensors, llm-compressor) stay inside the fixtures: the kernel
# tests under tests/runtime/kernels must collect on a GPU machine that has only torch, triton and
# transformers (scripts/gpu_check.sh).
from kvq.data.embedded_model import SmolLM2Paths
from tests.runtime.cpu_isa import cpu_isa  # noqa: F401  (a fixture: every CPU W4A16 path in turn)

Int4Checkpoint = Callable[..., Path]
# (arch, source format) -> (recipe, group size): llama all-INT4 (group 64: SmolLM2's 576 needs it);
# glm4_moe from FP8-block with INT4 experts and FP8 attention/dense MLP kept in block form (mixed).
RECIPES = {"llama": ("w4a16-linear", 64), "glm4_moe": ("w4a16-experts", 128)}


def model_free_ptq(source: Path, out: Path, recipe: str, group_size: int) -> Path:
    """llm-compressor's output for `recipe`, leaving alone what kvq keeps at source precision."""
    from kvq.bench.compress import run_model_free_ptq
    from tests.compress.conftest import kept_modules

    run_model_free_ptq(str(source), str(out), recipe, 1, group_size, kept_modules(source, recipe, group_size))
    return out


def compress(source: Path, out: Path, recipe: str, group_size: int, target: str = "vllm") -> Path:
    from kvq.compress.recipe import load_recipe
    from kvq.compress.runner import prepare, run

    run(prepare(source, out, load_recipe(recipe, group_size), target), workers=1)
    return out


@pytest.fixture(params=[torch.bfloat16, torch.float8_e4m3fn])
def cache_dtype(request: pytest.FixtureRequest) -> torch.dtype:
    """Each dtype of KV pages in turn: bf16, FP8 E4M3 (a test's own parametrize of `cache_dtype` overrides
    it)."""
    return request.param


@pytest.fixture(scope="session")
def int4_checkpoint(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Int4Checkpoint:
    """`int4_checkpoint(arch, writer="kvq")`: the tiny llama (from BF16) or glm4_moe (from FP8-block)
    compressed by kvq (`kvq`: target vllm, `kvq-sglang`: target sglang), or by llm-compressor's
    `model_free_ptq` with the same recipe."""
    built: dict[str, Path] = {}

    def get(arch: str, writer: str = "kvq") -> Path:
        if (arch, writer) not in built:
            source = tiny_checkpoint(arch, "fp8-block" if arch == "glm4_moe" else "bf16")
            out = tmp_path_factory.mktemp(f"{arch}-int4-{writer}") / "model"
            if writer in ("kvq", "kvq-sglang"):
                target = "sglang" if writer == "kvq-sglang" else "vllm"
                built[arch, writer] = compress(source, out, *RECIPES[arch], target)
            else:  # llm-compressor's own: FP8 attention dequantized to bf16, experts INT4
                assert writer == "model_free_ptq", writer
                built[arch, writer] = model_free_ptq(source, out, *RECIPES[arch])
        return built[arch, writer]

    return get


@pytest.fixture(scope="session")
def smollm2_int4(smollm2: SmolLM2Paths, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compress(smollm2.bf16, tmp_path_factory.mktemp("smollm2-int4") / "model", "w4a16-linear", 64)


@pytest.fixture(scope="session")
def smollm2_int4_calibrated(smollm2_int4: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The INT4 SmolLM2 with FP8 KV scales from `kvq calibrate` (a small run: 4 windows of 256 tokens; the
    bf16 layer forward is most of this fixture's time, and 8 x 512 gave no closer agreement)."""
    from kvq.calibrate.calibrate_checkpoint import calibrate
    from kvq.calibrate.calibration_config import CalibrationConfig

    path = Path(shutil.copytree(smollm2_int4, tmp_path_factory.mktemp("smollm2-int4-kv") / "model"))
    calibrate(path, CalibrationConfig(num_samples=4, seq_len=256))
    return path


MlaCheckpoint = Callable[[str, str], Path]
MLA_FORMATS = ("bf16", "int4-from-bf16", "int4-from-fp8-block", "kimi-int4")


@pytest.fixture(scope="session")
def mla_checkpoint(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> MlaCheckpoint:
    """`mla_checkpoint(arch, fmt)`: a tiny glm_moe_dsa / deepseek_v3 fixture as BF16, kvq-compressed with
    `w4a16-experts` (INT4 experts; FP8-block attention when the source is FP8-block) from BF16 or from
    FP8-block, or (deepseek_v3) in Kimi K2.6's native INT4 layout; each built once per session."""
    built: dict[tuple[str, str], Path] = {}

    def get(arch: str, fmt: str) -> Path:
        assert fmt in MLA_FORMATS, fmt
        if (arch, fmt) not in built:
            if fmt.startswith("int4-from-"):
                source = tiny_checkpoint(arch, fmt.removeprefix("int4-from-"))
                out = tmp_path_factory.mktemp(f"{arch}-{fmt}") / "model"
                built[arch, fmt] = compress(source, out, "w4a16-experts", 128)
            else:
                built[arch, fmt] = tiny_checkpoint(arch, fmt)
        return built[arch, fmt]

    return get
