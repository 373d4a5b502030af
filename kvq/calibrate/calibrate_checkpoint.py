"""`calibrate(path, config)`: validate, sample text, stream the layers, write the scales; the library entry.

Every check that can fail on user input (dataset, sequence length, attention layers, tokenizer,
existing scales, config.json, manifest) runs before the first layer is loaded, and nothing is written
until every layer has been observed, so a failed run leaves the checkpoint as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvq import __version__
from kvq.calibrate.calibration_config import CalibrationConfig
from kvq.calibrate.layer_stream import embed, meta_model, run_layers
from kvq.calibrate.mtp_stream import run_mtp_layers
from kvq.calibrate.observed_kv import ObservedKV, layer_tensor_names, observed_kv
from kvq.calibrate.observers import KvRecorder
from kvq.calibrate.samples import CalibrationSamples, build_samples
from kvq.calibrate.scales import layer_scales
from kvq.calibrate.scales_record import SCALES_FILE, UNIT_FILES
from kvq.calibrate.write_scales import apply_update, prepare_update
from kvq.checkpoint.file_commit import recover
from kvq.checkpoint.model_config import TextModel, pretrained_config, text_model
from kvq.checkpoint.mtp_layers import mtp_layer_indexes
from kvq.checkpoint.reader import CONFIG_NAME, Checkpoint
from kvq.checkpoint.writable import check_writable_dir
from kvq.data.texts import load_texts, source_name
from kvq.errors import KvqError

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
OBSERVED = {
    "gqa": "post-RoPE K and V, per KV head, as they enter the cache",
    "mla": "the cached MLA latent: kv_c (kv_a_layernorm output) and k_pe (after RoPE)",
}

LayerDone = Callable[[int], None]


@dataclass(frozen=True)
class CalibrationResult:
    layout: ObservedKV
    samples: CalibrationSamples
    recorder: KvRecorder
    scales: dict[str, torch.Tensor]  # tensor name (as stored, with the weight prefix) -> bf16 scale
    record: dict  # the manifest's kv_calibration entry


def calibrate(
    path: str | Path,
    config: CalibrationConfig,
    on_layer_done: LayerDone | None = None,
    on_start: Callable[[int], None] | None = None,
) -> CalibrationResult:
    """Calibrate FP8 KV scales for the checkpoint at `path` and write them into it."""
    prepare_to_write(Path(path))
    ckpt = Checkpoint.open(path)
    model = text_model(ckpt.config, str(ckpt.root / CONFIG_NAME))
    lm = ckpt.under(model.weight_prefix)  # the language model, in transformers' tensor names
    layout = observed_kv(model.fields, model.at)
    check_run(layout, config, str(ckpt.root / CONFIG_NAME))
    layer_names = layer_tensor_names(lm, layout.num_layers)
    samples = calibration_samples(ckpt.root, config)
    # Fail now, not after the forward, on anything writing would reject (foreign scales, bad JSON).
    prepare_update(ckpt, {}, config.strategy, {})
    mtp = stored_mtp_layers(lm, model.fields)
    if on_start is not None:
        on_start(layout.num_layers)
    recorder = measure_kv(
        lm, model, layout, layer_names, samples.input_ids, DTYPES[config.dtype], on_layer_done, mtp
    )
    scales: dict[str, torch.Tensor] = {}
    for i in [*range(layout.num_layers), *mtp]:
        scales |= layer_scales(layout, config.strategy, i, recorder.amax[i])
    record = run_record(layout, config, samples, recorder, scales)
    scales = {model.checkpoint_name(name): scale for name, scale in scales.items()}
    apply_update(ckpt, scales, prepare_update(ckpt, scales, config.strategy, record))
    return CalibrationResult(layout, samples, recorder, scales, record)


def prepare_to_write(root: Path) -> None:
    """Before any work: the checkpoint must take new files, and a calibration a kill left half-written
    is rolled back (the run then writes it whole)."""
    if root.is_dir():
        check_writable_dir(root, "checkpoint directory (kvq calibrate adds its scales to it)")
        recover(root, UNIT_FILES)


def check_run(layout: ObservedKV, config: CalibrationConfig, where: str) -> None:
    """Reject settings the model cannot take: too long samples, per-head scales for a one-latent cache."""
    if layout.max_positions and config.seq_len > layout.max_positions:
        raise KvqError(
            f"--seq-len {config.seq_len} exceeds the model's max_position_embeddings "
            f"({layout.max_positions}, {where}); use --seq-len {layout.max_positions} or less"
        )
    if config.strategy == "attn_head" and layout.is_mla:
        raise KvqError(
            f"{where}: an MLA model caches one latent per token (kv_c + k_pe), not per-head K/V, "
            "and servers quantize it with one scale; use --strategy tensor"
        )


def calibration_samples(root: Path, config: CalibrationConfig) -> CalibrationSamples:
    """The token windows `config` names, tokenized with the checkpoint's own tokenizer (at `root`)."""
    return build_samples(
        load_texts(config.dataset, config.split),
        load_tokenizer(root),
        num_samples=config.num_samples,
        seq_len=config.seq_len,
        seed=config.seed,
        source=source_name(config.dataset),
    )


def load_tokenizer(root: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(root)
    except (OSError, ValueError, TypeError) as e:
        raise KvqError(
            f"{root}: cannot load the tokenizer ({e}); calibration tokenizes text with the model's "
            "own tokenizer: copy tokenizer.json and tokenizer_config.json from the source model"
        ) from e


def stored_mtp_layers(ckpt: Checkpoint, fields: dict) -> range:
    """The MTP layers config.json declares and `ckpt` stores (they have their own attention and KV
    cache: calibrated too); empty when any of them has no attention tensors."""
    indexes = mtp_layer_indexes(fields)
    stored = all(any(n.startswith(f"model.layers.{i}.self_attn.") for n in ckpt.tensors) for i in indexes)
    return indexes if stored else range(0)


def measure_kv(
    ckpt: Checkpoint,
    model: TextModel,
    layout: ObservedKV,
    layer_names: list[list[str]],
    input_ids: torch.Tensor,
    dtype: torch.dtype,
    on_layer_done: LayerDone | None = None,
    mtp: range = range(0),
) -> KvRecorder:
    """Stream the layers of `ckpt` (the language model, in transformers' names) over `input_ids` `[N, S]`,
    then the MTP layers `mtp`, and return the running maxima (no writing)."""
    hf_model = meta_model(pretrained_config(model), dtype)
    state = embed(hf_model, ckpt, input_ids)
    recorder = KvRecorder(layout)
    run_layers(hf_model, ckpt, layer_names, state, recorder, on_layer_done)
    if mtp:
        run_mtp_layers(hf_model, ckpt, state, input_ids, mtp, recorder)
    return recorder


def run_record(
    layout: ObservedKV,
    config: CalibrationConfig,
    samples: CalibrationSamples,
    recorder: KvRecorder,
    scales: dict[str, torch.Tensor],
) -> dict:
    """The manifest entry: what was observed, on which tokens, and every layer's amax and scales."""
    layers = []
    for i in sorted(recorder.amax):  # the decoder layers, then any MTP layers
        prefix = f"model.layers.{i}.self_attn."
        layers.append(
            {
                "layer": i,
                "num_tokens": recorder.num_tokens.get(i, 0),
                "amax": {name: recorder.amax[i][name].tolist() for name in layout.observed},
                "k_scale": scales[prefix + "k_scale"].float().flatten().tolist(),
                "v_scale": scales[prefix + "v_scale"].float().flatten().tolist(),
            }
        )
    return {
        "kvq_version": __version__,
        "observed": OBSERVED[layout.kind],
        "kv_layout": asdict(layout),
        "strategy": config.strategy,
        "scale": "amax / 448 (float8_e4m3fn max), bfloat16",
        "tensor_file": SCALES_FILE,
        "dataset": {
            "source": samples.source,
            "split": config.split,
            "num_texts": samples.num_texts,
            "num_stream_tokens": samples.num_stream_tokens,
            "token_ids_sha256": samples.fingerprint,
        },
        "num_samples": config.num_samples,
        "seq_len": config.seq_len,
        "seed": config.seed,
        "dtype": config.dtype,
        "layers": layers,
    }
