"""`kvq bench decode --model glm_moe_dsa`: MLA decode speed on the glm_moe_dsa bench fixture, in one run.

The fixture (`kvq.fixtures` size "bench": 10 layers, hidden 1024, 64 experts top-4, MLA with kv_lora 256,
GLM-5's DSA indexer with index_topk 64; random weights) stored as GLM-5-FP8 ships (FP8 128x128 blocks),
and kvq's `w4a16-experts` output of it (INT4 experts, FP8-block attention); both calibrated (`kvq
calibrate`: one k_scale per layer on the latent). Contenders: each weight form with BF16 and with FP8
latent pages; prompts longer than index_topk, so the indexer selects at every decode step. Decode tok/s
at concurrency 1 and 32 (32 prompts decoded together), by (N - 1) / (t(N) - t(1)) per sequence as in
`kvq bench decode`, contenders taking turns, median; the ratios INT4 / FP8-block weights and FP8 / BF16
latent come from the same run. Built once under `kvq.paths.cache_dir()/bench`.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.table import Table

from kvq.bench.decode_speed import FixtureDecodeConfig, Generate, decode_tok_s
from kvq.paths import cache_dir

WEIGHTS = ("fp8-block", "int4")
LATENTS = ("bf16", "fp8_e4m3")


@dataclass(frozen=True)
class MlaBenchConfig(FixtureDecodeConfig):
    batch_size: int = 32
    calib_samples: int = 8
    calib_seq_len: int = 256


@dataclass
class MlaBenchResult:
    config: dict
    tok_s: dict[str, float] = field(default_factory=dict)  # per sequence, by contender and concurrency
    kv_bytes_per_token: dict[str, int] = field(default_factory=dict)


def bench_models(config: MlaBenchConfig) -> dict[str, Path]:
    """The FP8-block fixture and its w4a16-experts output, both calibrated, built once."""
    from kvq.calibrate.calibrate_checkpoint import calibrate
    from kvq.calibrate.calibration_config import CalibrationConfig
    from kvq.compress.recipe import load_recipe
    from kvq.compress.runner import prepare, run
    from kvq.fixtures.checkpoint_fixtures import build_fixture

    root = cache_dir() / "bench"
    paths = {
        "fp8-block": root / "glm_moe_dsa-bench-fp8-block-kv",
        "int4": root / "glm_moe_dsa-bench-w4a16-kv",
    }
    calibration = CalibrationConfig(num_samples=config.calib_samples, seq_len=config.calib_seq_len)
    if not (paths["fp8-block"] / "kv_scales.safetensors").is_file():
        build_fixture("glm_moe_dsa", "fp8-block", paths["fp8-block"], size="bench")
        calibrate(paths["fp8-block"], calibration)
    if not (paths["int4"] / "kv_scales.safetensors").is_file():
        run(prepare(paths["fp8-block"], paths["int4"], load_recipe("w4a16-experts", 128)), workers=1)
        calibrate(paths["int4"], calibration)
    return paths


def mla_generate(path: Path, config: MlaBenchConfig, kv_cache_dtype: str, batch_size: int) -> Generate:
    """`batch_size` distinct random prompts of `prompt_tokens` (no prefix page shared), greedy."""
    from kvq.runtime.config import EngineConfig
    from kvq.runtime.engine import Engine
    from kvq.runtime.sampling import SamplingParams

    e = Engine(
        EngineConfig(
            model=str(path),
            threads=config.threads,
            page_size=config.page_size,
            kv_cache_dtype=kv_cache_dtype,
            kv_memory="128MiB",
            max_num_seqs=batch_size,
            require_kv_scales=True,
        )
    )
    gen = torch.Generator().manual_seed(batch_size)
    vocab = e.model.config.vocab_size
    prompts = [
        torch.randint(3, vocab, (config.prompt_tokens,), generator=gen).tolist() for _ in range(batch_size)
    ]
    return lambda n: e.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))


def run_mla_bench(config: MlaBenchConfig) -> MlaBenchResult:
    from kvq.checkpoint.kv_cache_spec import kv_cache_spec
    from kvq.checkpoint.model_config import read_text_model
    from kvq.runtime.kv_layout import layout_for
    from kvq.runtime.kv_pool import page_bytes

    torch.set_num_threads(config.threads)
    result = MlaBenchResult(config=asdict(config))
    paths = bench_models(config)
    for batch_size in (1, config.batch_size):
        contenders = {
            name(weights, latent, batch_size): mla_generate(paths[weights], config, latent, batch_size)
            for weights in WEIGHTS
            for latent in LATENTS
        }
        runs = decode_tok_s(contenders, 1, config.new_tokens, config.repeats)  # tok/s per sequence
        result.tok_s.update({contender: statistics.median(r) for contender, r in runs.items()})
        del contenders
    model = read_text_model(paths["int4"])
    spec = kv_cache_spec(model.fields, model.at)
    for latent, dtype in zip(LATENTS, (torch.bfloat16, torch.float8_e4m3fn), strict=True):
        result.kv_bytes_per_token[latent] = page_bytes(layout_for(spec, dtype), spec.num_layers, 1)
    return result


def name(weights: str, latent: str, batch_size: int) -> str:
    return f"{weights} weights, {latent} latent, concurrency {batch_size}"


def render_mla(result: MlaBenchResult) -> Table:
    table = Table(title="kvq bench decode --model glm_moe_dsa (bench fixture, random weights)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    tok, batch = result.tok_s, result.config["batch_size"]
    for contender, value in tok.items():
        concurrency = int(contender.rsplit(" ", 1)[1])
        table.add_row(contender, f"{value:.2f} tok/s per sequence, {value * concurrency:.1f} total")
    for batch_size in (1, batch):
        for latent in LATENTS:
            ratio = tok[name("int4", latent, batch_size)] / tok[name("fp8-block", latent, batch_size)]
            table.add_row(
                f"INT4 / FP8-block weights ({latent} latent, concurrency {batch_size})", f"{ratio:.2f}x"
            )
        for weights in WEIGHTS:
            ratio = tok[name(weights, "fp8_e4m3", batch_size)] / tok[name(weights, "bf16", batch_size)]
            table.add_row(f"FP8 / BF16 latent ({weights} weights, concurrency {batch_size})", f"{ratio:.2f}x")
    bytes_per_token = result.kv_bytes_per_token
    table.add_row(
        "KV bytes per token bf16 / fp8 latent (index keys bf16 in both)",
        f"{bytes_per_token['bf16']} / {bytes_per_token['fp8_e4m3']}",
    )
    return table
