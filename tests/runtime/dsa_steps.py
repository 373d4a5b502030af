"""GLM-5's DSA selection step by step, for the runtime tests: transformers' (hooks on its indexers) and
kvq's (each full indexer's `Selection` after every step of a teacher-forced run), as the positions each
query attends to; and a replay that makes an engine's indexers choose what another run chose."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import PreTrainedModel

from kvq.runtime.engine import Engine
from kvq.runtime.layers.dsa_indexer import Indexer, Selection
from kvq.runtime.sampling import SamplingParams
from tests.runtime.reference import hf_greedy

Choices = list[list[set[int]]]  # per full indexer layer, per query position: the positions it attends to


def transformers_choices(model: PreTrainedModel, prompt: list[int], num_tokens: int) -> Choices:
    """transformers' greedy run (a prefill, then decode steps) as `Choices` (masked picks dropped)."""
    recorded: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    hooks = [
        layer.self_attn.indexer.register_forward_hook(lambda m, args, out, i=i: recorded[i].append(out[0]))
        for i, layer in enumerate(model.model.layers)
    ]
    hf_greedy(model, prompt, num_tokens)
    for hook in hooks:
        hook.remove()
    rows_by_layer = [torch.cat(per_layer) for per_layer in recorded]  # [S + num_tokens, k]: row = position
    return [[{p for p in row.tolist() if p <= at} for at, row in enumerate(rows)] for rows in rows_by_layer]


def indexers(engine: Engine) -> list[Indexer]:
    return [
        layer.self_attn.indexer
        for layer in engine.model.layers
        if isinstance(layer.self_attn.indexer, Indexer)
    ]


def teacher_forced_selections(engine: Engine, prompt: list[int], forced: list[int]) -> list[list[Selection]]:
    """Per full indexer, its `Selection` after the prefill of `prompt` and after each forced decode step."""
    seq = engine.make_sequence(prompt, SamplingParams(max_tokens=len(forced) + 1))
    engine.block_manager.allocate(seq)
    engine.runner.run([seq], is_prefill=True)
    steps = [[ix.last for ix in indexers(engine)]]
    for token in forced:
        seq.token_ids.append(token)
        engine.block_manager.may_append(seq)
        engine.runner.run([seq], is_prefill=False)
        steps.append([ix.last for ix in indexers(engine)])
    engine.block_manager.deallocate(seq)
    return [list(per_layer) for per_layer in zip(*steps, strict=True)]


def as_choices(selections: list[list[Selection]], prompt_len: int) -> Choices:
    """`teacher_forced_selections` as `Choices` (a dense step: every position up to the query)."""
    out: Choices = []
    for per_step in selections:
        rows: list[set[int]] = []
        prefill, decode = per_step[0], per_step[1:]
        masks = prefill.prefill_masks
        for at in range(prompt_len):
            rows.append(
                set(range(at + 1))
                if masks is None or masks[0] is None
                else set(masks[0][at].nonzero().flatten().tolist())
            )
        for at, step in enumerate(decode, start=prompt_len):
            indices = step.token_indices
            rows.append(set(range(at + 1)) if indices is None else {p for p in indices[0].tolist() if p >= 0})
        out.append(rows)
    return out


def on_device(selection: Selection, device: torch.device) -> Selection:
    masks = selection.prefill_masks
    return Selection(
        None if masks is None else [None if mask is None else mask.to(device) for mask in masks],
        None if selection.token_indices is None else selection.token_indices.to(device),
    )


def replay(engine: Engine, selections: list[list[Selection]]) -> None:
    """Make `engine`'s full indexers return `selections` (per indexer, per step) in order, one a call, on
    the engine's device."""
    device = engine.kv_pool.storage.device
    for indexer, recorded in zip(indexers(engine), selections, strict=True):
        steps: Iterator[Selection] = iter([on_device(selection, device) for selection in recorded])

        def select(*args, indexer=indexer, steps=steps) -> Selection:
            indexer.last = next(steps)
            return indexer.last

        indexer.select = select  # type: ignore[method-assign]
