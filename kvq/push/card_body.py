"""The Markdown body of a kvq model card: what was done (recipe), what it saved (sizes), how the KV cache
was calibrated, what it cost (the `kvq eval` tables) and how to serve it. Pure text from the manifest,
config.json and the eval report; imports kvq.eval.report and kvq.commands.render only.
"""

from __future__ import annotations

from kvq.byte_sizes import format_bytes
from kvq.eval.report import engine_line, markdown_tables


def card_body(repo_id: str, base_model: str, config: dict, manifest: dict, report: dict | None) -> str:
    name = repo_id.split("/")[-1]
    has_kv_scales = bool((config.get("quantization_config") or {}).get("kv_cache_scheme"))
    recipe = manifest.get("recipe") or {}
    summary = (
        f"# {name}\n\n[{base_model}](https://huggingface.co/{base_model}) with its weights quantized to INT4 "
        f"(W4A16, group size {recipe.get('group_size')}, symmetric) in compressed-tensors `pack-quantized` "
        "form"
        + (", and calibrated FP8 (e4m3) KV-cache scales" if has_kv_scales else "")
        + ", by kvq (`kvq compress`"
        + (", `kvq calibrate`" if has_kv_scales else "")
        + ")."
    )
    sections = [
        summary,
        _recipe(manifest),
        _sizes(manifest),
        _kv_calibration(manifest.get("kv_calibration")),
        _evaluation(report),
        _serving(repo_id, name, has_kv_scales),
    ]
    return "\n\n".join(s for s in sections if s) + "\n"


def _recipe(manifest: dict) -> str:
    recipe = manifest.get("recipe") or {}
    kept = manifest.get("kept_at_source_precision") or []
    lines = [
        f"- recipe `{recipe.get('name')}` (sha256 `{str(recipe.get('sha256'))[:16]}`), group size "
        f"{recipe.get('group_size')}, targets {', '.join(recipe.get('targets') or [])}",
        f"- not quantized: {', '.join(f'`{p}`' for p in recipe.get('ignore') or []) or 'nothing'}",
        f"- kept at source precision (shape not a multiple of the group): {len(kept)} tensor(s)"
        + (f", e.g. `{kept[0]['name']}`" if kept else ""),
        f"- source: {(manifest.get('source') or {}).get('format')} checkpoint, fingerprint "
        f"`{str((manifest.get('source') or {}).get('fingerprint'))[:16]}`; kvq {manifest.get('kvq_version')}",
    ]
    if recipe.get("text"):
        lines += ["", "The recipe file as given (kvq compress `--group-size` overrides its `group_size`):"]
        lines += ["", "```yaml", recipe["text"].rstrip(), "```"]
    return _section("Recipe", lines)


def _sizes(manifest: dict) -> str:
    after = sum(record["bytes"] for record in (manifest.get("shards") or {}).values())
    before = (manifest.get("source") or {}).get("bytes")
    lines = ["| | weights on disk |", "|---|---:|"]
    if before:
        lines.append(f"| source | {format_bytes(before)} ({before:,} bytes) |")
    lines.append(
        f"| this checkpoint | {format_bytes(after)} ({after:,} bytes)"
        + (f", {after / before:.2f}x the source" if before else "")
        + " |"
    )
    if not before:
        lines += ["", "(the source size was not recorded by the kvq compress run that wrote this checkpoint)"]
    return _section("Size", lines)


def _kv_calibration(record: dict | None) -> str:
    if not record:
        return ""
    dataset = record.get("dataset") or {}
    layers = record.get("layers") or []
    lines = [
        f"- observed: {record.get('observed')}; scale = {record.get('scale')}; strategy "
        f"`{record.get('strategy')}`",
        f"- {record.get('num_samples')} x {record.get('seq_len')} tokens of {dataset.get('source')} "
        f"({dataset.get('split')} split; token ids sha256 `{str(dataset.get('token_ids_sha256'))[:16]}`), "
        f"seed {record.get('seed')}",
    ]
    for key in ("k_scale", "v_scale"):
        values = [v for layer in layers for v in layer.get(key) or []]
        if values:
            lines.append(f"- `{key}` over {len(layers)} layers: {min(values):.4g} to {max(values):.4g}")
    return _section("KV cache calibration", lines)


def _evaluation(report: dict | None) -> str:
    if report is None:
        return "## Evaluation\n\nNot evaluated: this card was pushed without a `kvq eval --json` report."
    settings = report["settings"]
    items = (
        [
            f"held-out text: {settings['num_windows']} windows x {settings['seq_len']} tokens of "
            f"{settings['text_source']}"
        ]
        if "text" in settings["tasks"]
        else []
    )
    num_docs = {m["task"]: m["num_items"] for m in report["runs"][0]["metrics"] if m.get("task")}
    for task, found in (settings.get("task_versions") or {}).items():
        shots = f", {found['num_fewshot']}-shot" if found["num_fewshot"] else ""
        items.append(
            f"`{task}`: lm-evaluation-harness task version {found['version']}{shots}, "
            f"{num_docs.get(task, '?')} documents"
        )
    return _section(
        "Evaluation",
        [
            f"Measured by `kvq eval` (kvq {report['kvq_version']}) with lm-evaluation-harness's tasks, "
            f"computed by {engine_line(report)}; deltas are model - baseline on the same items, "
            "with a paired 95% interval.",
            "",
            *(f"- {item}" for item in items),
            "",
            markdown_tables(report),
        ],
    )


def _serving(repo_id: str, name: str, has_kv_scales: bool) -> str:
    kv = " --kv-cache-dtype fp8_e4m3" if has_kv_scales else ""
    return _section(
        "Serving",
        [
            "```bash",
            f"vllm serve {repo_id}{kv}",
            f"python -m sglang.launch_server --model-path {repo_id}{kv}",
            f"hf download {repo_id} --local-dir {name} && kvq serve {name}{kv}"
            + (" --require-kv-scales" if has_kv_scales else ""),
            "```",
        ],
    )


def _section(title: str, lines: list[str]) -> str:
    return "\n".join([f"## {title}", "", *lines])
