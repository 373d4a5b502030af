"""Routed experts: each expert's input Hessians from the tokens the router sent it.

transformers keeps a layer's routed experts fused (`mlp.experts.gate_up_proj` `[E, 2I, H]`, gate rows
first, and `down_proj` `[E, H, I]`), called as `experts(hidden [T, H], top_k_index [T, k], weights)`.
`ExpertInputs` records those calls (one per sample) during the calibration forward; `expert_hessians`
then builds, one expert at a time (so memory holds one expert's Hessians, not all of them), the sums
for gate/up (their common input: the routed tokens' hidden states) and for down (`act(gate) * up` of
those tokens, with the unquantized weights, as the forward computed it). Tokens are taken in the order
transformers and llm-compressor visit them (`torch.where` over the `[k, T]` one-hot mask), one sum term
per sample. With `all_tokens`, every token feeds every expert's Hessians (llm-compressor's
`moe_calibrate_all_experts`); the layer's output still comes from the real routing. Imports torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from kvq.gptq.hessian import HessianSum

GATE_UP, DOWN = "gate_up_proj", "down_proj"


@dataclass
class RoutedTokens:
    """One sample's tokens grouped by expert: `order[offsets[e]:offsets[e + 1]]` are expert e's tokens."""

    order: torch.Tensor  # [T * k] int64 token indices, by expert, then top-k slot, then token
    offsets: torch.Tensor  # [E + 1] int64


class ExpertInputs:
    """Every sample's input to one routed-experts module and its routing, recorded while `hooked()`."""

    def __init__(self, experts: nn.Module, num_experts: int) -> None:
        self.experts = experts
        self.num_experts = num_experts
        self.hidden: list[torch.Tensor] = []  # per sample [T, H] in the compute dtype
        self.routed: list[RoutedTokens] = []

    @contextmanager
    def hooked(self) -> Iterator[None]:
        handle = self.experts.register_forward_pre_hook(self._record, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def _record(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        self.hidden.append(hidden.detach())
        self.routed.append(route(top_k_index, self.num_experts))

    def num_tokens(self, expert: int) -> int:
        """Tokens routed to `expert` over all samples (a token counts once per top-k slot naming it)."""
        return sum(int(r.offsets[expert + 1] - r.offsets[expert]) for r in self.routed)


def route(top_k_index: torch.Tensor, num_experts: int) -> RoutedTokens:
    """Group the tokens of `top_k_index` `[T, k]` by expert, in `torch.where(one_hot_mask[e])` order."""
    num_tokens = top_k_index.shape[0]
    flat = top_k_index.t().reshape(-1)  # [k * T]: slot-major, as the [E, k, T] mask is scanned
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(counts, 0)
    return RoutedTokens(order % num_tokens, offsets)


def expert_hessians(
    experts: nn.Module, inputs: ExpertInputs, expert: int, *, all_tokens: bool
) -> tuple[HessianSum, HessianSum]:
    """(gate/up input Hessian `[H, H]`, down input Hessian `[I, I]`) of one expert, unquantized weights."""
    gate_up = getattr(experts, GATE_UP)[expert]  # [2I, H]
    down = getattr(experts, DOWN)[expert]  # [H, I]
    act_fn: nn.Module = experts.act_fn  # type: ignore[assignment]
    h_in, h_down = HessianSum(gate_up.shape[1]), HessianSum(down.shape[1])
    with torch.no_grad():
        for hidden, routed in zip(inputs.hidden, inputs.routed, strict=True):
            if all_tokens:
                x = hidden
            else:
                x = hidden[routed.order[routed.offsets[expert] : routed.offsets[expert + 1]]]  # [n, H]
            h_in.add(x)
            gate, up = nn.functional.linear(x, gate_up).chunk(2, dim=-1)
            h_down.add(act_fn(gate) * up)
    return h_in, h_down
