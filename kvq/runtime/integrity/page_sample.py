"""Which bytes of a sealed page `--kv-integrity full` hashes, and with which weights.

In every layer, in the page's K half and its V half, `samples_per_slot` byte positions in each token
slot's row (Hkv * D * itemsize bytes), drawn once per pool from a fixed seed: a token's K/V written over
a sealed page changes sampled bytes in every layer, and a change of any one sampled byte always changes
the hash (odd weights, no overflow: `kernels.integrity_check`). A change in an unsampled byte is not
seen: a random single-bit flip is caught with probability samples_per_slot / row bytes.
Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SAMPLES_PER_SLOT = 2
SEED = 0x6B7671  # "kvq"


@dataclass(frozen=True)
class PageSample:
    offsets: torch.Tensor  # [S] int64: byte positions within one page's K (or V) half, S = page_size * k
    coeffs: torch.Tensor  # [L, 2, S] int64: odd weights in [1, 2^31), per layer, K/V and position


def make_page_sample(
    num_layers: int,
    page_size: int,
    row_bytes: int,
    device: torch.device,
    samples_per_slot: int = SAMPLES_PER_SLOT,
    seed: int = SEED,
) -> PageSample:
    """`samples_per_slot` distinct positions in each of the page's `page_size` rows of `row_bytes`."""
    if not 1 <= samples_per_slot <= row_bytes:
        raise ValueError(f"samples_per_slot must be in [1, {row_bytes}], got {samples_per_slot}")
    gen = torch.Generator().manual_seed(seed)
    in_row = torch.stack(
        [torch.randperm(row_bytes, generator=gen)[:samples_per_slot] for _ in range(page_size)]
    )
    offsets = (torch.arange(page_size)[:, None] * row_bytes + in_row.sort(dim=1).values).flatten()
    coeffs = torch.randint(0, 1 << 30, (num_layers, 2, offsets.numel()), generator=gen) * 2 + 1
    return PageSample(offsets.to(device), coeffs.to(device))
