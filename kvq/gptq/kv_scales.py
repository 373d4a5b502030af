"""`--calibrate-kv`: the FP8 KV scales GPTQ's propagation pass observed, on the quantized layers.

The per-layer maxima are kept in the manifest as each layer finishes (`restore_amax` reads them back on
a resumed run), then turned into `k_scale` / `v_scale` and written into OUT exactly as `kvq calibrate`
writes them (kv_scales.safetensors, index, config.json kv_cache_scheme, manifest kv_calibration).
Imports torch and kvq.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch

from kvq.calibrate.calibrate_checkpoint import run_record
from kvq.calibrate.observers import KvRecorder
from kvq.calibrate.scales import layer_scales
from kvq.calibrate.write_scales import MANIFEST_KEY, apply_update, prepare_update
from kvq.checkpoint.reader import Checkpoint
from kvq.compress.manifest import read_manifest

if TYPE_CHECKING:
    from kvq.gptq.gptq_job import GptqJob

OBSERVED_ON = "the GPTQ-quantized layers, in kvq compress --method gptq's propagation pass"


def layer_record(recorder: KvRecorder, layer_idx: int) -> dict:
    """What the manifest keeps of one layer's observations (fp32 values survive JSON exactly)."""
    observed = recorder.amax.get(layer_idx, {})
    return {
        "num_tokens": recorder.num_tokens.get(layer_idx, 0),
        "amax": {name: t.tolist() for name, t in observed.items()},
    }


def restore_amax(recorder: KvRecorder, records: dict) -> None:
    """Put the maxima of recorded layers (`{layer: {"kv": layer_record}}`) back into `recorder`."""
    for key, record in records.items():
        kv = record["kv"]
        recorder.amax[int(key)] = {n: torch.tensor(v, dtype=torch.float32) for n, v in kv["amax"].items()}
        recorder.num_tokens[int(key)] = kv["num_tokens"]


def write_kv_scales(job: GptqJob, recorder: KvRecorder) -> bool:
    """Write the scales into OUT unless the same ones are already there; return whether it wrote."""
    strategy = job.config.calibration.strategy
    scales: dict[str, torch.Tensor] = {}
    for i in range(job.layout.num_layers):
        scales |= layer_scales(job.layout, strategy, i, recorder.amax[i])
    record = run_record(job.layout, job.config.calibration, job.samples, recorder, scales)
    record["observed_on"] = OBSERVED_ON
    scales = {job.text.checkpoint_name(name): scale for name, scale in scales.items()}
    out = job.compress.out
    if (read_manifest(out) or {}).get(MANIFEST_KEY) == json.loads(json.dumps(record)):
        return False
    ckpt = Checkpoint.open(out)
    apply_update(ckpt, scales, prepare_update(ckpt, scales, strategy, record))
    return True
