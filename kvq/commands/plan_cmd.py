"""`kvq plan SRC --recipe R`: what `kvq compress` would write, from headers (or a bare config.json) only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvq.byte_sizes import SIZE_HELP, format_bytes, parse_bytes
from kvq.commands.recipe_options import GroupSizeOption, RecipeOption
from kvq.commands.render import console, human_count
from kvq.compress.recipe import load_recipe
from kvq.compress.serving_memory import ServingMemory, serving_memory
from kvq.compress.size_plan import SizePlan, size_plan
from kvq.compress.source import PlanSource, open_source
from kvq.compress.tensor_plan import TARGETS, build_plan
from kvq.errors import KvqError
from kvq.kv_cache_dtypes import AUTO, KV_CACHE_DTYPE_HELP, KV_CACHE_DTYPES, kv_cache_dtype_flag

_SHOWN_KEPT = 8


def plan_command(
    src: Annotated[
        Path,
        typer.Argument(
            help="Checkpoint directory, or a config.json (file or folder) to plan "
            "a model without downloading it."
        ),
    ],
    recipe: RecipeOption,
    group_size: GroupSizeOption = None,
    tp: Annotated[int | None, typer.Option("--tp", help="Tensor-parallel GPUs to serve on.")] = None,
    gpu_mem: Annotated[
        str | None, typer.Option("--gpu-mem", help=f"Memory per GPU, e.g. 80GB or 141GiB. {SIZE_HELP}")
    ] = None,
    kv_cache_dtype: Annotated[
        str, typer.Option("--kv-cache-dtype", help=KV_CACHE_DTYPE_HELP, callback=kv_cache_dtype_flag)
    ] = AUTO,
    old_kv_dtype: Annotated[
        str | None, typer.Option("--kv-dtype", hidden=True, help="Renamed: --kv-cache-dtype.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Plan a compression: per module kind, tensors, parameters and bytes before and after, the exact output
    size, and with --tp/--gpu-mem the weight memory per GPU and the KV-cache tokens that fit. Reads headers
    only; writes nothing."""
    if old_kv_dtype is not None:
        raise KvqError(
            f"--kv-dtype is now --kv-cache-dtype ({', '.join(KV_CACHE_DTYPES)}, as vLLM names them)"
        )
    source = open_source(src)
    the_recipe = load_recipe(recipe, group_size)
    plan = build_plan(source.tensors, the_recipe, source.block)
    sizes = size_plan(plan, source.file_bytes)
    target_bytes = {  # the same plan for each --target of kvq compress (the table above is vllm's)
        target: size_plan(build_plan(source.tensors, the_recipe, source.block, target), 0).output_file_bytes
        for target in TARGETS
    }
    memory = None
    if tp is not None or gpu_mem is not None:
        if tp is None or gpu_mem is None:
            raise KvqError("--tp and --gpu-mem go together: pass both (e.g. --tp 8 --gpu-mem 141GiB)")
        gpu_mem_bytes = parse_bytes(gpu_mem, "--gpu-mem")
        memory = serving_memory(source.config, sizes.total.bytes_after, tp, gpu_mem_bytes, kv_cache_dtype)
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
                },
                indent=2,
            )
        )
        return
    console.print(render(source, sizes))
    console.print(
        "output by --target: "
        + ", ".join(f"{target} {format_bytes(n)} ({n} B)" for target, n in target_bytes.items())
    )
    _print_kept(sizes)
    if memory is not None:
        console.print(_render_memory(memory))


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


def _render_memory(memory: ServingMemory) -> Table:
    table = Table(
        title=f"serving on {memory.tp} GPU(s) of {format_bytes(memory.gpu_mem_bytes)}, "
        f"KV {memory.kv_cache_dtype}"
    )
    table.add_column("per GPU", justify="left")
    table.add_column("value", justify="right")
    table.add_row("weights", format_bytes(memory.weight_bytes_per_gpu))
    table.add_row(
        "left for KV cache", format_bytes(max(0, memory.gpu_mem_bytes - memory.weight_bytes_per_gpu))
    )
    table.add_row("KV bytes per token", f"{memory.kv_bytes_per_token_per_gpu} ({memory.kv_layout})")
    table.add_row(
        "[bold]KV tokens that fit[/bold]",
        human_count(memory.kv_tokens) if memory.kv_tokens else "0: the weights do not fit; raise --tp",
    )
    return table
