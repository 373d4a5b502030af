"""The group scales GPTQ holds fixed: round-to-nearest's min/max, or llm-compressor's MSE grid search.

`observer: mse` in a recipe's weights is llm-compressor 0.14's `MovingAverageMSEObserver` on a weight (one
observation, so no averaging): its eager `_grid_search_mse` with the defaults `maxshrink` 0.2, `grid` 100,
`norm` 2.4, `patience` 5, `expand` 1.0, each of which a recipe's `observer_kwargs` may set (`MSE_KWARGS`).
The group's range is first widened by `expand`; then for each shrink `p = 1 - i / grid`,
`i < maxshrink * grid`, every group's range `[p * min, p * max]` gives a candidate scale
(`calculate_qparams`), the group is fake-quantized with it in the weight's dtype D and its error is
`sum |q - w| ** norm`, in D; a group keeps the first candidate with the smallest error; the search stops
once `patience` candidates in a row improve no group. Every op runs in D as compressed-tensors runs it,
so the scales are bit-identical. Imports torch, kvq.formats and kvq.compress.gptq_settings.
"""

from __future__ import annotations

import torch

from kvq.compress.gptq_settings import MSE_KWARGS
from kvq.formats.pack_quantized import INT4_MAX, INT4_MIN, quantize_int4_group


def observe_weight_scale(
    weight: torch.Tensor, group_size: int, observer: str, observer_kwargs: dict[str, float] | None = None
) -> torch.Tensor:
    """`weight_scale` `[out, in / group_size]` in `weight`'s dtype, as `observer` computes it."""
    if observer == "mse":
        return mse_weight_scale(weight, group_size, **(observer_kwargs or {}))
    assert observer == "minmax", observer
    return quantize_int4_group(weight, group_size)[1]


@torch.no_grad()
def mse_weight_scale(
    weight: torch.Tensor,
    group_size: int,
    maxshrink: float = MSE_KWARGS["maxshrink"],
    grid: float = MSE_KWARGS["grid"],
    norm: float = MSE_KWARGS["norm"],
    patience: float = MSE_KWARGS["patience"],
    expand: float = MSE_KWARGS["expand"],
) -> torch.Tensor:
    """llm-compressor's MSE observer's `weight_scale` of `weight` `[out, in]`, in its dtype."""
    groups = weight.unflatten(-1, (-1, group_size))  # [out, G, g] in D
    min_val, max_val = groups.amin(dim=-1) * expand, groups.amax(dim=-1) * expand  # [out, G]
    best_error = torch.full_like(min_val, torch.finfo(min_val.dtype).max)
    best_scale = _scale(min_val, max_val)
    no_improve_count = 0
    for i in range(int(maxshrink * grid)):
        p = 1 - i / grid
        scale = _scale(min_val * p, max_val * p)
        q = torch.round(torch.clamp(groups / scale.unsqueeze(-1), INT4_MIN, INT4_MAX)) * scale.unsqueeze(-1)
        error = torch.sum((q - groups).abs().pow(norm), dim=-1)  # [out, G] in D
        improved = error < best_error
        if torch.any(improved):
            best_error[improved] = error[improved]
            best_scale[improved] = scale[improved]
            no_improve_count = 0
        else:
            no_improve_count += 1
            if no_improve_count >= patience:
                break
    return best_scale


def _scale(min_val: torch.Tensor, max_val: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' symmetric INT4 `calculate_qparams` scale, in the dtype D of its inputs."""
    zeros = torch.zeros_like(min_val)
    max_val_pos = torch.max(torch.abs(torch.min(min_val, zeros)), torch.abs(torch.max(max_val, zeros)))
    scale = max_val_pos / (torch.tensor(INT4_MAX - INT4_MIN, dtype=max_val_pos.dtype) / 2)
    eps = torch.tensor(torch.finfo(scale.dtype).eps, dtype=scale.dtype)
    return torch.where(scale == 0, eps, scale)
