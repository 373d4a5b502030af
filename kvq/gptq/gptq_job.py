"""`kvq compress --method gptq` end to end: validate, stream the layers through GPTQ, write the shards.

`prepare_gptq` checks everything before any work (the compress plan, the calibration text and its
tokens, every target's place in transformers' model, OUT). `run_gptq` then
1. streams the decoder layers (`layer.quantize_layer`), staging each finished layer (`staging`) and
   recording it in the manifest, so a rerun resumes at the first layer not finished;
2. writes the output shards with `kvq compress`'s runner, the GPTQ'd tensors copied from the staging
   files (every other tensor exactly as round-to-nearest writes it), index, config.json and manifest;
3. with `calibrate_kv`, writes the KV scales measured in the same pass on the quantized layers;
then removes the staging files. Imports torch, transformers and kvq.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedModel

from kvq.calibrate.calibrate_checkpoint import DTYPES, calibration_samples, check_run
from kvq.calibrate.layer_stream import StreamState, embed, layer_inputs, meta_model
from kvq.calibrate.layer_weights import load_layer_weights
from kvq.calibrate.memory import limit_primitive_cache, release_freed
from kvq.calibrate.observed_kv import ObservedKV, layer_tensor_names, observed_kv
from kvq.calibrate.observers import KvRecorder
from kvq.calibrate.samples import CalibrationSamples
from kvq.checkpoint.header import ShardHeader, read_header
from kvq.checkpoint.model_config import TextModel, pretrained_config, text_model
from kvq.checkpoint.reader import CONFIG_NAME, Checkpoint
from kvq.compress.gptq_settings import GptqSettings
from kvq.compress.manifest import read_manifest, write_manifest
from kvq.compress.recipe import Recipe
from kvq.compress.runner import CompressReport, PreparedJob, manifest_header, prepare, run
from kvq.compress.tensor_plan import VLLM
from kvq.errors import KvqError
from kvq.gptq import staging
from kvq.gptq.gptq_config import GptqConfig
from kvq.gptq.kv_scales import layer_record, restore_amax, write_kv_scales
from kvq.gptq.layer import CALIBRATED, LayerOptions, quantize_layer
from kvq.gptq.targets import NOT_REACHED, LayerTargets, dense_in_features, find_targets

MANIFEST_KEY = "gptq"
# llm-compressor calibrates with eager attention (`use_eager_attention`); so does kvq, for the same Hessians.
EAGER_ATTENTION = "eager"
LayerDone = Callable[[int], None]


@dataclass
class GptqJob:
    """A validated GPTQ job: nothing has been written yet."""

    compress: PreparedJob
    settings: GptqSettings
    config: GptqConfig
    samples: CalibrationSamples
    layout: ObservedKV
    text: TextModel  # config.json's language model (its fields, the prefix of its tensor names)
    lm: Checkpoint  # the source's language-model tensors, in transformers' names
    model: PreTrainedModel  # on the meta device
    targets: list[LayerTargets]
    unreached: list[str]
    layer_names: list[list[str]]

    @property
    def num_layers(self) -> int:
        return len(self.targets)


@dataclass
class GptqReport:
    compress: CompressReport
    layers_done: list[int] = field(default_factory=list)
    layers_resumed: int = 0
    rtn_fallback: dict[str, str] = field(default_factory=dict)  # module -> reason
    num_gptq: int = 0
    kv_scales_written: bool = False


def prepare_gptq(
    src: str | Path, out: str | Path, recipe: Recipe, config: GptqConfig, target: str = VLLM
) -> GptqJob:
    """Validate the whole GPTQ job for the serving `target`; raise `KvqError` on anything that would fail
    later."""
    ckpt = Checkpoint.open(src)
    where = str(ckpt.root / CONFIG_NAME)
    text = text_model(ckpt.config, where)
    layout = observed_kv(text.fields, text.at)
    calibration = config.calibration
    check_run(layout, calibration, where)
    samples = calibration_samples(ckpt.root, calibration)
    settings = recipe.gptq or GptqSettings()
    compress = prepare(src, out, recipe, target, method=method_record(settings, config, samples))
    lm = compress.ckpt.under(text.weight_prefix)
    model_config = pretrained_config(text)
    model_config._attn_implementation = EAGER_ATTENTION
    model = meta_model(model_config, DTYPES[calibration.dtype])
    targets, unreached = find_targets(
        compress.plan, model.model.layers, type(model).__name__, text.weight_prefix
    )
    _check_enough_tokens(compress, targets, samples)
    layer_names = layer_tensor_names(lm, layout.num_layers)
    return GptqJob(
        compress, settings, config, samples, layout, text, lm, model, targets, unreached, layer_names
    )


def method_record(settings: GptqSettings, config: GptqConfig, samples: CalibrationSamples) -> dict:
    """The method part of the job identity: GPTQ's settings and exactly which calibration tokens."""
    c = config.calibration
    return {
        "name": "gptq" if config.gptaq_alpha is None else "gptaq",
        "gptq": settings.record(),
        "options": config.record(),
        "calibration": {
            "source": samples.source,
            "split": c.split,
            "num_samples": c.num_samples,
            "seq_len": c.seq_len,
            "seed": c.seed,
            "token_ids_sha256": samples.fingerprint,
        },
    }


def _check_enough_tokens(
    compress: PreparedJob, targets: list[LayerTargets], samples: CalibrationSamples
) -> None:
    """Every non-expert target sees every token: fewer tokens than its inputs make its Hessian singular."""
    num_tokens = samples.input_ids.numel()
    widest = dense_in_features(targets, compress.plan)
    if widest:
        name, columns = max(widest.items(), key=lambda kv: kv[1])  # the first of the widest
        if num_tokens < columns:
            raise KvqError(
                f"{samples.source}: {samples.input_ids.shape[0]} samples x {samples.input_ids.shape[1]} "
                f"tokens = {num_tokens} calibration tokens, fewer than the {columns} inputs of {name}: its "
                f"Hessian would be singular; raise --num-samples or --seq-len (at least {columns} tokens "
                "in all), or give more text with --dataset"
            )


def run_gptq(
    job: GptqJob,
    workers: int,
    on_layer_done: LayerDone | None = None,
    progress: Callable[[int], None] | None = None,
    on_write_start: Callable[[int], None] | None = None,
) -> GptqReport:
    """Write OUT (resuming an interrupted run of the same job); return what was done. `on_write_start`
    gets the bytes the shard writing will read (`progress` then counts them)."""
    out = job.compress.out
    out.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out)
    if manifest is None:
        manifest = write_manifest(out, manifest_header(job.compress, {}, is_complete=False))
    is_done = bool(manifest.get("complete")) and _all_shards_intact(out, manifest)
    if manifest.get("complete") and not is_done:  # a finished shard was lost: its staging is gone, redo
        manifest = write_manifest(out, {"complete": False, MANIFEST_KEY: {}})
    records = dict((manifest.get(MANIFEST_KEY) or {}).get("layers", {}))
    report = GptqReport(CompressReport(out))
    if is_done:
        report.compress.shards_resumed = sorted(manifest["shards"])
        report.layers_resumed = job.num_layers
    else:
        start = _first_unfinished(out, records, job.num_layers)
        report.layers_resumed = start
        records = {k: v for k, v in records.items() if int(k) < start}
        _stream_layers(job, start, records, report, on_layer_done)
        staged: dict[str, ShardHeader] = {}
        for i, record in records.items():
            header = read_header(staging.layer_path(out, int(i)))
            staged |= {name: header for name, m in record["modules"].items() if m["method"] in CALIBRATED}
        jobs = staging.staged_jobs(job.compress.jobs, staged)
        if on_write_start is not None:
            on_write_start(sum(j.input_bytes for j in jobs))
        report.compress = run(dataclasses.replace(job.compress, jobs=jobs), workers, progress)
    _summarize(job, records, report)
    if job.config.calibrate_kv:
        recorder = KvRecorder(job.layout)
        restore_amax(recorder, records)
        report.kv_scales_written = write_kv_scales(job, recorder)
    staging.remove_staging(out)
    return report


def _all_shards_intact(out: Path, manifest: dict) -> bool:
    return all(staging.is_intact(out / name, rec) for name, rec in (manifest.get("shards") or {}).items())


def _first_unfinished(out: Path, records: dict, num_layers: int) -> int:
    """The first layer without a recorded, intact staging file (and the state before it intact)."""
    for i in range(num_layers):
        record = records.get(str(i))
        if record is None or not staging.is_intact(staging.layer_path(out, i), record["file"]):
            break
    else:
        i = num_layers
    while i > 0 and not staging.is_intact(staging.state_path(out, i - 1), records[str(i - 1)]["state"]):
        i -= 1
    return i


def _stream_layers(
    job: GptqJob,
    start: int,
    records: dict,
    report: GptqReport,
    on_layer_done: LayerDone | None,
) -> None:
    out, ckpt, lm, model = job.compress.out, job.compress.ckpt, job.lm, job.model
    if start >= job.num_layers:
        return
    limit_primitive_cache()
    recorder = KvRecorder(job.layout)  # this run's layers; earlier ones are in `records`
    input_ids = job.samples.input_ids
    gptaq = job.config.gptaq_alpha is not None
    if start == 0:
        state = embed(model, lm, input_ids)
        fp_state = StreamState([h.clone() for h in state.hidden], list(state.topk)) if gptaq else None
    else:
        state, fp_state = staging.load_state(out, start - 1, input_ids.shape[0], gptaq)
    inputs = layer_inputs(model, lm, state.hidden[0])
    options = LayerOptions(
        job.compress.recipe.group_size,
        job.settings,
        job.config.moe_min_tokens,
        job.config.moe_calibrate_all_experts,
        job.config.gptaq_alpha,
        job.config.true_sequential,
    )
    for i in range(start, job.num_layers):
        layer = model.model.layers[i]
        load_layer_weights(layer, lm, i, job.layer_names[i])
        outcome = quantize_layer(
            layer.eval(), i, job.targets[i], state, inputs, recorder, options, ckpt, fp_state
        )
        layer.to_empty(device="meta")
        release_freed()
        records[str(i)] = {
            "file": staging.write_tensors(staging.layer_path(out, i), outcome.tensors),
            "state": staging.save_state(out, i, state, fp_state),
            "modules": outcome.modules,
            "kv": layer_record(recorder, i),
        }
        write_manifest(out, {MANIFEST_KEY: {"layers": records}})
        staging.drop_states_before(out, i)
        report.layers_done.append(i)
        if on_layer_done is not None:
            on_layer_done(i)


def _summarize(job: GptqJob, records: dict, report: GptqReport) -> None:
    """Count GPTQ'd modules and list every RTN fallback (report and manifest)."""
    for record in records.values():
        for name, m in record["modules"].items():
            if m["method"] in CALIBRATED:
                report.num_gptq += 1
            else:
                report.rtn_fallback[name] = m["reason"]
    report.rtn_fallback |= dict.fromkeys(job.unreached, NOT_REACHED)
    summary = {
        "layers": records,
        "num_gptq": report.num_gptq,
        "rtn_fallback": [{"name": n, "reason": r} for n, r in sorted(report.rtn_fallback.items())],
    }
    if (read_manifest(job.compress.out) or {}).get(MANIFEST_KEY) != summary:  # a finished rerun: no write
        write_manifest(job.compress.out, {MANIFEST_KEY: summary})
