"""GPTAQ (`kvq compress --method gptaq`): GPTQ fitted to the full-precision model's outputs.

The arithmetic: with no asymmetry (or alpha 0) it is GPTQ's, bit for bit; within one block it is the
reference implementation's column update written out plainly here; on inputs that a quantized model
upstream has moved, its codes reproduce the full-precision outputs better than GPTQ's. The run: the
full-precision states are carried (and staged, so a resumed run ends byte-identical), every dense
Linear is recorded as GPTAQ'd, routed experts as GPTQ'd, and alpha 0 writes GPTQ's weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvq.bench.compress_gptq import printed_bound
from kvq.bench.measure import run_measured
from kvq.calibrate.calibration_config import CalibrationConfig
from kvq.checkpoint.header import read_header
from kvq.compress.manifest import read_manifest
from kvq.compress.recipe import load_recipe
from kvq.formats.pack_quantized import INT4_MAX, INT4_MIN
from kvq.gptq.algorithm import gptq_quantize
from kvq.gptq.gptq_config import GptqConfig
from kvq.gptq.gptq_job import GptqReport, prepare_gptq, run_gptq
from kvq.gptq.hessian import HessianSum
from kvq.gptq.staging import STAGING_DIR, state_path
from tests.calibrate.test_errors import snapshot
from tests.compress.conftest import compress_argv
from tests.conftest import TinyCheckpoint

CALIBRATION = CalibrationConfig(num_samples=10, seq_len=64)


def inputs(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight, full-precision inputs X_fp `[samples, T, in]` (uneven columns) and X = X_fp moved by an
    upstream quantization error (correlated with X_fp, as a quantized model's are)."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(rows, cols, generator=gen) * 0.02).bfloat16()
    x_fp = torch.randn(8, 64, cols, generator=gen) * (torch.rand(cols, generator=gen) * 3 + 0.2)
    mix = torch.eye(cols) + 0.1 * torch.randn(cols, cols, generator=gen) / cols**0.5
    x = x_fp @ mix + 0.05 * torch.randn(x_fp.shape, generator=gen)
    return weight, x_fp, x


def sums(x_fp: torch.Tensor, x: torch.Tensor) -> HessianSum:
    h = HessianSum(x.shape[-1], asymmetric=True)
    for a, b in zip(x_fp, x, strict=True):
        h.add(b.unsqueeze(0), a.unsqueeze(0))
    return h


def test_cross_sum_is_the_reference_dxxt() -> None:
    _w, x_fp, x = inputs(4, 48, 0)
    h = sums(x_fp, x)
    a, b = x_fp.reshape(-1, 48).double(), x.reshape(-1, 48).double()
    torch.testing.assert_close(h.normalized(), (2 * b.T @ b / 8).float(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(h.normalized_cross(), (2 * (a - b).T @ b / 8).float(), rtol=1e-5, atol=1e-4)
    assert HessianSum(48).normalized_cross() is None


@pytest.mark.parametrize("actorder", [True, False])
def test_no_asymmetry_or_alpha_zero_is_gptq_bit_for_bit(actorder: bool) -> None:
    weight, x_fp, x = inputs(70, 192, 1)
    h = sums(x_fp, x)
    kwargs = {"group_size": 32, "block_size": 64, "actorder": actorder}
    gptq = gptq_quantize(weight, h.normalized(), **kwargs)
    zero = gptq_quantize(weight, h.normalized(), asymmetry=torch.zeros(192, 192), **kwargs)
    alpha0 = gptq_quantize(weight, h.normalized(), asymmetry=h.normalized_cross(), alpha=0.0, **kwargs)
    gptaq = gptq_quantize(weight, h.normalized(), asymmetry=h.normalized_cross(), **kwargs)
    for other in (zero, alpha0):
        assert torch.equal(other.codes, gptq.codes) and torch.equal(other.weight_scale, gptq.weight_scale)
    assert not torch.equal(gptaq.codes, gptq.codes)
    assert torch.equal(gptaq.weight_scale, gptq.weight_scale)  # the observer sees the weight alone


def plain_gptaq(
    weight: torch.Tensor, hessian: torch.Tensor, asymmetry: torch.Tensor, alpha: float, group: int
):
    """GPTAQ in one block, no activation order, written from the method: each column quantized with its
    group's scale, its error spread over the later columns through the inverse Hessian's Cholesky factor,
    and `w P[i, i:]` added, with P = alpha triu(A Hinv^T, 1) Hinv."""
    scale = gptq_quantize(weight, hessian, group_size=group, actorder=False).weight_scale.float()
    W = weight.double().clone()
    H = hessian.double().clone()
    H += 0.01 * H.diagonal().mean() * torch.eye(H.shape[0], dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    P = alpha * torch.triu(asymmetry.double() @ U.T, diagonal=1) @ U
    codes = torch.empty(W.shape, dtype=torch.int8)
    for i in range(W.shape[1]):
        w = W[:, i].clone()
        s = scale[:, i // group].double()
        q = torch.round(torch.clamp(w / s, INT4_MIN, INT4_MAX))
        codes[:, i] = q.to(torch.int8)
        err = (w - (q * s).to(weight.dtype).double()) / U[i, i]  # the dequantized value is in D
        W[:, i:] -= torch.outer(err, U[i, i:]) - torch.outer(w, P[i, i:])
    return codes


def test_one_block_equals_the_plain_column_update() -> None:
    weight, x_fp, x = inputs(64, 128, 2)
    h = sums(x_fp, x)
    kvq = gptq_quantize(
        weight, h.normalized(), group_size=32, block_size=128, actorder=False, asymmetry=h.normalized_cross()
    )
    plain = plain_gptaq(weight, h.normalized(), h.normalized_cross(), 0.25, 32)
    assert (kvq.codes == plain).float().mean() >= 0.995  # fp32 vs fp64: a rounding tie may fall apart
    gptq = gptq_quantize(weight, h.normalized(), group_size=32, block_size=128, actorder=False)
    assert (gptq.codes == plain).float().mean() < 0.95


@pytest.mark.parametrize("alpha", [0.25, 1.0])
def test_gptaq_reproduces_the_full_precision_outputs_better(alpha: float) -> None:
    weight, x_fp, x = inputs(96, 256, 3)
    h = sums(x_fp, x)
    kwargs = {"group_size": 64, "block_size": 64}

    def error(codes: torch.Tensor, scale: torch.Tensor) -> float:
        dequant = codes.float() * scale.float().repeat_interleave(64, dim=1)
        return float(((x_fp @ weight.float().T - x @ dequant.T) ** 2).sum())

    gptq = gptq_quantize(weight, h.normalized(), **kwargs)
    gptaq = gptq_quantize(weight, h.normalized(), asymmetry=h.normalized_cross(), alpha=alpha, **kwargs)
    assert error(gptaq.codes, gptaq.weight_scale) < 0.9 * error(gptq.codes, gptq.weight_scale)


class Interrupted(Exception):
    pass


def stop(_layer_idx: int) -> None:
    raise Interrupted


def compress(src: Path, out: Path, alpha: float | None, recipe: str = "w4a16-linear", **kwargs) -> GptqReport:  # noqa: ANN003
    config = GptqConfig(CALIBRATION, gptaq_alpha=alpha, moe_min_tokens=0)
    return run_gptq(prepare_gptq(src, out, load_recipe(recipe, 64), config), 2, **kwargs)


@pytest.mark.slow
def test_gptaq_run_resumes_byte_identical_and_alpha_zero_writes_gptq(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    src = tiny_checkpoint("llama", "fp8-block")
    whole = tmp_path / "whole"
    report = compress(src, whole, 0.25)
    assert report.layers_done == [0, 1] and report.num_gptq == 14
    manifest = read_manifest(whole)
    assert manifest is not None and manifest["job"]["method"]["name"] == "gptaq"
    assert manifest["job"]["method"]["options"]["gptaq_alpha"] == 0.25
    modules = {n: m for layer in manifest["gptq"]["layers"].values() for n, m in layer["modules"].items()}
    assert len(modules) == 14 and {m["method"] for m in modules.values()} == {"gptaq"}

    out = tmp_path / "out"
    with pytest.raises(Interrupted):
        compress(src, out, 0.25, on_layer_done=stop)
    staged = read_header(state_path(out, 0)).tensors
    assert {f"fp.hidden.{s}" for s in range(10)} <= set(staged) and "hidden.9" in staged
    report = compress(src, out, 0.25)
    assert (report.layers_resumed, report.layers_done) == (1, [1])
    assert not (out / STAGING_DIR).exists() and snapshot(out) == snapshot(whole)

    gptq, zero = tmp_path / "gptq", tmp_path / "alpha0"
    compress(src, gptq, None)
    compress(src, zero, 0.0)
    weights = lambda d: {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}  # noqa: E731
    a, b, c = weights(gptq), weights(zero), weights(whole)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # layer 0 sees the same inputs in both models (X_fp = X: GPTQ's codes); layer 1's differ
    packed = [k for k in a if k.endswith("weight_packed")]
    assert len(packed) == 14
    assert {k for k in packed if not torch.equal(a[k], c[k])} == {k for k in packed if ".layers.1." in k}


def compress_within_printed_bound(src: Path, out: Path, recipe: str, *args: str) -> str:
    """Run `kvq compress SRC OUT --recipe RECIPE ARGS... --workers 2 --quiet`, measured; assert it succeeds
    with its peak RSS within the bound it printed; return its output."""
    measured = run_measured(compress_argv(src, out, recipe, *args, "--workers", "2", "--quiet"))
    assert measured.returncode == 0, measured.output
    assert measured.peak_rss_bytes <= printed_bound(measured.output), measured.output
    return measured.output


@pytest.mark.slow
def test_cli_on_moe_routed_experts_stay_gptq_within_the_printed_bound(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    """glm4_moe with every Linear targeted (q/k/v carry biases: their bias tasks share the module name)."""
    src, out = tiny_checkpoint("glm4_moe", "bf16"), tmp_path / "out"
    args = ["--group-size", "64", "--method", "gptaq", "--num-samples", "10", "--seq-len", "64"]
    output = compress_within_printed_bound(src, out, "w4a16-linear", *args, "--moe-min-tokens", "0")
    assert "--method gptaq (alpha 0.25)" in output and "kvq (tp 1): loads" in output
    manifest = read_manifest(out)
    assert manifest is not None
    modules = {
        n: m["method"] for rec in manifest["gptq"]["layers"].values() for n, m in rec["modules"].items()
    }
    experts = {n: m for n, m in modules.items() if ".mlp.experts." in n}
    dense = {n: m for n, m in modules.items() if ".mlp.experts." not in n}
    assert experts and set(experts.values()) == {"gptq"}
    assert "model.layers.0.self_attn.q_proj" in dense and set(dense.values()) == {"gptaq"}


@pytest.mark.slow
def test_mla_dsa_fixture_carries_both_models_top_k(tiny_checkpoint: TinyCheckpoint, tmp_path: Path) -> None:
    """glm_moe_dsa: the full-precision stream carries its own DSA top-k picks beside the quantized one's;
    KV scales (the MLA latent) come from the quantized model's pass, as GPTQ's do."""
    src, out = tiny_checkpoint("glm_moe_dsa", "bf16"), tmp_path / "gptaq"
    config = GptqConfig(CALIBRATION, moe_min_tokens=0, calibrate_kv=True, gptaq_alpha=0.25)
    job = prepare_gptq(src, out, load_recipe("w4a16-linear", 64), config)
    report = run_gptq(job, workers=2)
    assert report.num_gptq == len(job.compress.plan.int4_modules) and report.kv_scales_written
    manifest = read_manifest(out)
    assert manifest is not None
    methods = {
        n: m["method"] for rec in manifest["gptq"]["layers"].values() for n, m in rec["modules"].items()
    }
    assert {m for n, m in methods.items() if ".mlp.experts." not in n} == {"gptaq"}
    assert manifest["kv_calibration"]["kv_layout"]["kind"] == "mla"
