"""`kvq plan SRC [--recipe R]`: what `kvq compress` would write, or for an already-compressed checkpoint what
it holds, and with `--tp/--gpu-mem` the weights per GPU and the KV tokens (BF16 vs FP8) that fit.

Reads headers (or a bare config.json) only."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from kvq.byte_sizes import SIZE_HELP, format_bytes, parse_bytes
from kvq.checkpoint.kv_cache_spec import kv_cache_spec
from kvq.checkpoint.model_config import weight_prefix_of
from kvq.commands.inspect_cmd import render as render_stored
from kvq.commands.recipe_options import GroupSizeOption, warn_if_unmatched
from kvq.commands.render import console, human_count
from kvq.compress.recipe import available_recipes, load_recipe
from kvq.compress.serving_memory import KV_CACHE_DTYPES, ServingMemory, serving_memory, weight_bytes
from kvq.compress.size_plan import SizePlan, output_file_bytes, size_plan
from kvq.compress.source import PlanSource, open_source
from kvq.compress.tensor_plan import TARGETS, build_plan
from kvq.errors import KvqError
from kvq.inspect import summarize_tensors

if TYPE_CHECKING:
    from kvq.commands.plan_deployment import DeploymentCheck

_SHOWN_KEPT = 8


def plan_command(
    ctx: typer.Context,
    src: Annotated[
        Path,
        typer.Argument(
            help="Checkpoint directory, or a config.json (file or folder) to plan "
            "a model without downloading it."
        ),
    ],
    recipe: Annotated[
        str | None,
        typer.Option(
            "--recipe",
            help="Recipe name in recipes/ (w4a16-experts, w4a16-linear) or a YAML path. Needed for a source "
            "kvq compress would compress; not for an already-compressed checkpoint (kvq's own output, Kimi "
            "K2.6's native INT4, a config.json with a compressed-tensors quantization_config).",
        ),
    ] = None,
    group_size: GroupSizeOption = None,
    tp: Annotated[
        int | None,
        typer.Option(
            "--tp", help="Tensor-parallel GPUs to serve on (no DP attention, no expert parallelism)."
        ),
    ] = None,
    gpu_mem: Annotated[
        str | None, typer.Option(help=f"Memory per GPU, e.g. 80GB or 141GiB. {SIZE_HELP}")
    ] = None,
    mem_fraction: Annotated[
        float,
        typer.Option(
            "--mem-fraction",
            help="SGLang's --mem-fraction-static: weights + KV pool <= this fraction of GPU memory. "
            "SGLang also takes out of that budget whatever is allocated before it sizes the pool (CUDA "
            "context, NCCL buffers); kvq does not model that, so its token count is an upper bound.",
        ),
    ] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="A serving config (configs/) whose deployment gives --tp, --gpu-mem, --mem-fraction and "
            "--recipe (flags override); the plan then says whether its KV dtype fits max_model_len.",
        ),
    ] = None,
    old_kv_dtype: Annotated[
        str | None, typer.Option("--kv-dtype", "--kv-cache-dtype", hidden=True, help="Not needed: see below.")
    ] = None,
) -> None:
    """Plan a compression: per module kind, tensors, parameters and bytes before and after, the exact output
    size; for an already-compressed checkpoint, what it stores. With --tp/--gpu-mem: the weight memory per
    GPU and the KV-cache tokens that fit, BF16 vs FP8 (e4m3). Reads headers only; writes nothing."""
    if old_kv_dtype is not None:
        raise KvqError(
            "kvq plan shows the KV tokens of every KV cache dtype side by side "
            f"({', '.join(KV_CACHE_DTYPES)}, vLLM's names): drop --kv-dtype / --kv-cache-dtype"
        )
    deployment = None
    if config is not None:
        from kvq.commands.plan_deployment import DeploymentCheck

        deployment = DeploymentCheck.read(config)
        tp, gpu_mem, mem_fraction, recipe = deployment.settings(ctx, tp, gpu_mem, mem_fraction, recipe)
    source = open_source(src)
    if tp is not None or gpu_mem is not None:
        if tp is None or gpu_mem is None:
            raise KvqError("--tp and --gpu-mem go together: pass both (e.g. --tp 8 --gpu-mem 141GiB)")
        _warn_uneven_heads(source.model.fields, tp)
    if source.is_compressed:
        if recipe is not None or group_size is not None:
            fmt = source.model.quantization_config.get("format") or "compressed-tensors"
            raise KvqError(
                f"{source.path}: already compressed ({fmt}); kvq plan shows what it holds and its "
                "serving memory: drop --recipe / --group-size"
            )
        _plan_stored(source, tp, gpu_mem, mem_fraction, as_json, deployment)
        return
    if recipe is None:
        raise KvqError(
            f"{source.path}: not compressed yet; pass --recipe (one of {', '.join(available_recipes())}, "
            "or a YAML path) to plan what kvq compress would write"
        )
    the_recipe = load_recipe(recipe, group_size)
    prefix = weight_prefix_of(source.config)
    plan = build_plan(source.tensors, the_recipe, source.block, weight_prefix=prefix)
    warn_if_unmatched(plan, the_recipe)
    sizes = size_plan(plan, source.file_bytes)
    target_bytes = {  # the output for each --target of kvq compress (the table is the default's)
        target: sizes.output_file_bytes
        if target == plan.target
        else output_file_bytes(build_plan(source.tensors, the_recipe, source.block, target, prefix))
        for target in TARGETS
    }
    memory = before = None
    if tp is not None and gpu_mem is not None:
        outputs = ((out.name, out.nbytes) for task in plan.tasks for out in task.outputs)
        memory = _serving(source, outputs, tp, gpu_mem, mem_fraction)
        before = _serving(
            source, ((i.name, i.nbytes) for i in source.tensors.values()), tp, gpu_mem, mem_fraction
        )
    fits = None if deployment is None or memory is None else deployment.verdict(memory)
    if as_json:
        print(
            json.dumps(
                {
                    "source": str(source.path),
                    "is_bare_config": source.is_bare_config,
                    "recipe": the_recipe.identity(),
                    "plan": sizes.to_json(),
                    "output_file_bytes_by_target": target_bytes,
                    "serving": memory.to_json() if memory else None,
                    "serving_source": before.to_json() if before else None,
                    **({"deployment": fits} if fits else {}),
                },
                indent=2,
            )
        )
        return
    console.print(render(source, sizes))
    _print_kept(sizes)
    console.print(
        "output by --target: "
        + ", ".join(f"{target} {format_bytes(n)} ({n} B)" for target, n in target_bytes.items())
    )
    if memory is not None and before is not None:
        console.print(_render_memory([("source as stored", before), (f"after {the_recipe.name}", memory)]))
    if fits is not None:
        console.print(fits["summary"])
        if not fits["fits"]:
            raise typer.Exit(1)


def _plan_stored(
    source: PlanSource,
    tp: int | None,
    gpu_mem: str | None,
    mem_fraction: float,
    as_json: bool,
    deployment: DeploymentCheck | None = None,
) -> None:
    """An already-compressed source: what it stores, and its serving memory."""
    num_shards = 1 if source.is_bare_config else len({i.file for i in source.tensors.values()})
    report = summarize_tensors(str(source.path), source.tensors.values(), num_shards, source.config)
    memory = None
    if tp is not None and gpu_mem is not None:
        memory = _serving(
            source, ((i.name, i.nbytes) for i in source.tensors.values()), tp, gpu_mem, mem_fraction
        )
    fits = None if deployment is None or memory is None else deployment.verdict(memory)
    if as_json:
        stored = {"source": str(source.path), "is_bare_config": source.is_bare_config, "recipe": None}
        serving = memory.to_json() if memory else None
        print(
            json.dumps(
                {
                    **stored,
                    "stored": report.to_json(),
                    "serving": serving,
                    **({"deployment": fits} if fits else {}),
                },
                indent=2,
            )
        )
        return
    console.print(render_stored(report))
    if source.is_bare_config:
        console.print("derived from config.json: language model only (a vision tower is not derived)")
    if memory is not None:
        console.print(_render_memory([("as stored", memory)]))
    if fits is not None:
        console.print(fits["summary"])
        if not fits["fits"]:
            raise typer.Exit(1)


def _warn_uneven_heads(fields: dict, tp: int) -> None:
    """Say so when --tp cannot split the attention heads as vLLM and SGLang need (`kvq check` names the
    rule): the numbers printed then describe a split no engine runs."""
    heads = fields.get("num_attention_heads")
    kv_heads = None if fields.get("kv_lora_rank") else (fields.get("num_key_value_heads") or heads)
    if not isinstance(heads, int) or heads < 1 or tp < 2:
        return
    problems = [f"{heads} attention heads"] if heads % tp else []
    is_kv_uneven = (
        isinstance(kv_heads, int) and kv_heads > 0 and (kv_heads % tp if kv_heads >= tp else tp % kv_heads)
    )
    if is_kv_uneven:
        problems.append(f"{kv_heads} KV heads")
    if problems:
        typer.echo(
            f"kvq plan: warning: --tp {tp} does not split {' and '.join(problems)} evenly: vLLM and SGLang "
            "refuse it (heads % tp == 0; KV heads split or replicated evenly); the memory below assumes "
            "an even split: choose a --tp that divides the heads",
            err=True,
        )


def _serving(
    source: PlanSource, tensors: Iterable[tuple[str, int]], tp: int, gpu_mem: str, mem_fraction: float
) -> ServingMemory:
    model = source.model
    spec = kv_cache_spec(model.fields, model.at)
    weights = weight_bytes(tensors, int(model.fields["num_hidden_layers"]))
    return serving_memory(spec, weights, tp, parse_bytes(gpu_mem, "--gpu-mem"), mem_fraction)


def render(source: PlanSource, sizes: SizePlan) -> Table:
    what = "bare config, shapes derived" if source.is_bare_config else "headers"
    table = Table(title=f"kvq plan: {source.path} ({what})")
    for col in ("module kind", "tensors", "parameters", "before", "after", "ratio"):
        table.add_column(col, justify="left" if col == "module kind" else "right")
    for kind, row in [*sizes.kinds.items(), ("total", sizes.total)]:
        ratio = f"{row.bytes_after / row.bytes_before:.2f}" if row.bytes_before else "-"
        table.add_row(
            f"[bold]{kind}[/bold]" if kind == "total" else kind,
            f"{row.tensors_before} -> {row.tensors_after}",
            human_count(row.parameters),
            format_bytes(row.bytes_before),
            format_bytes(row.bytes_after),
            ratio,
            end_section=kind == "total" or kind == list(sizes.kinds)[-1],
        )
    table.caption = (
        f"files: {format_bytes(sizes.source_file_bytes)} -> predicted {format_bytes(sizes.output_file_bytes)}"
        f" ({sizes.output_file_bytes} B); {sizes.num_int4} Linears to INT4, "
        f"{sizes.num_fp8_kept} kept FP8-block, {len(sizes.kept)} kept at source precision"
    )
    return table


def _print_kept(sizes: SizePlan) -> None:
    if not sizes.kept:
        return
    console.print(f"kept at source precision ({len(sizes.kept)}):")
    for kept in sizes.kept[:_SHOWN_KEPT]:
        console.print(f"  {kept.name} {list(kept.shape)}: {kept.reason}")
    if len(sizes.kept) > _SHOWN_KEPT:
        console.print(f"  ... and {len(sizes.kept) - _SHOWN_KEPT} more (--json lists all)")


def _render_memory(columns: list[tuple[str, ServingMemory]]) -> Table:
    """One column per way of serving the model (the source as stored, the recipe's output)."""
    first = columns[0][1]
    fraction = f"--mem-fraction {first.mem_fraction:g}"
    table = Table(title=f"serving on {first.tp} GPU(s) of {format_bytes(first.gpu_mem_bytes)}, {fraction}")
    table.add_column("per GPU", justify="left")
    for label, _ in columns:
        table.add_column(label, justify="right")

    def row(label: str, value: Callable[[ServingMemory], str]) -> None:
        table.add_row(label, *(value(memory) for _, memory in columns))

    row("weights", lambda m: format_bytes(m.weight_bytes_per_gpu))
    row(
        f"  replicated + split/{first.tp}",
        lambda m: f"{format_bytes(m.weights.replicated)} + {format_bytes(m.weights.split)}",
    )
    if any(m.weights.mtp for _, m in columns):
        row("MTP layers (loaded only to speculate)", lambda m: format_bytes(m.weights.mtp))
    row("KV pool: fraction x memory - weights", lambda m: format_bytes(m.kv_budget_bytes))
    for i, fit in enumerate(first.kv):
        indexer = f" ({fit.indexer_bytes_per_token} indexer)" if fit.indexer_bytes_per_token else ""
        table.add_row(
            f"KV bytes per token, {fit.kv_cache_dtype}",
            *(f"{m.kv[i].bytes_per_token}{indexer}" for _, m in columns),
        )
        table.add_row(
            "  kvq --kv-integrity tags/full",
            *(str(m.kv[i].kvq_checked_bytes_per_token) for _, m in columns),
        )
    for i, fit in enumerate(first.kv):
        label = f"[bold]KV tokens that fit, {fit.kv_cache_dtype}[/bold]"
        table.add_row(label, *(_tokens(m.kv[i].tokens) for _, m in columns))
    row(
        "fp8_e4m3 / bf16 tokens",
        lambda m: f"{m.kv[1].tokens / m.kv[0].tokens:.2f}x" if m.kv[0].tokens else "-",
    )
    table.caption = (
        f"KV cache: {first.kv_layout} (kvq's pool: these bytes with --kv-integrity off, the default; "
        "tags/full add an 8-byte slot stamp per layer). "
        f"Parallelism: {first.parallelism}"
    )
    return table


def _tokens(tokens: int) -> str:
    return f"{human_count(tokens)} ({tokens})" if tokens else "0: the weights do not fit; raise --tp"
