"""Which bytes of a sealed page `--kv-integrity full` hashes, and with which weights.

In every layer, in each part of the page (GQA: its K half and its V half; MLA: the one latent part),
`samples_per_slot` byte positions in each token slot's row (`KVPool.row_bytes`), drawn once per pool
from a fixed seed: a token's cache entry written over a sealed page changes sampled bytes in every
layer, and a change of any one sampled byte always changes the hash (odd weights, no overflow:
`kernels.integrity.page_check`). A change in an unsampled byte is not seen: a random single-bit flip is
caught with probability samples_per_slot / row bytes.
Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SAMPLES_PER_SLOT = 2
SEED = 0x6B7671  # "kvq"


@dataclass(frozen=True)
class PageSample:
    offsets: torch.Tensor  # [S] int64: byte positions within one part of a page, S = page_size * k
    coeffs: torch.Tensor  # [L, C, S] int64: odd weights in [1, 2^31), per layer, part and position


def make_page_sample(
    num_layers: int,
    page_size: int,
    row_bytes: int,
    device: torch.device,
    samples_per_slot: int = SAMPLES_PER_SLOT,
    seed: int = SEED,
    num_parts: int = 2,
) -> PageSample:
    """`samples_per_slot` distinct positions in each of the page's `page_size` rows of `row_bytes`, in
    each of `num_parts` parts."""
    if not 1 <= samples_per_slot <= row_bytes:
        raise ValueError(f"samples_per_slot must be in [1, {row_bytes}], got {samples_per_slot}")
    gen = torch.Generator().manual_seed(seed)
    in_row = torch.stack(
        [torch.randperm(row_bytes, generator=gen)[:samples_per_slot] for _ in range(page_size)]
    )
    offsets = (torch.arange(page_size)[:, None] * row_bytes + in_row.sort(dim=1).values).flatten()
    coeffs = torch.randint(0, 1 << 30, (num_layers, num_parts, offsets.numel()), generator=gen) * 2 + 1
    return PageSample(offsets.to(device), coeffs.to(device))
