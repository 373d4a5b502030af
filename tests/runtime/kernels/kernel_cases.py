"""Fresh random kernel inputs of irregular shapes, and the one closeness check the kernel tests use.

Weights are packed with kvq's `pack_int4` (equal to compressed-tensors' `pack_to_int32`, the layout's
oracle, in test_w4a16.py; not imported here, so the kernel tests run where only torch and triton are).
Paged caches put sequences on shuffled pages with unused pages, a page shared by two sequences,
block-table padding of -1 and garbage, and NaN in every slot no sequence owns, so a kernel that reads
past seq_len shows it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvq.formats.fp8_e4m3 import FP8_E4M3_MAX
from kvq.formats.pack_quantized import pack_int4
from kvq.runtime.kernels import DecodeTables, PagedKVCache
from kvq.runtime.kernels.paged.latent_cache import PagedLatentCache
from kvq.runtime.kv_layout import LatentLayout

# Tolerances, as a fraction of max |expected|, by the dtype the kernel computes and returns in.
REL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """max |actual - expected| <= rel * max |expected| (in fp32), with the numbers in the message."""
    assert actual.shape == expected.shape, (tuple(actual.shape), tuple(expected.shape))
    err = (actual.float() - expected.float()).abs().max().item() if expected.numel() else 0.0
    bound = rel * max(expected.float().abs().max().item() if expected.numel() else 0.0, 1e-6)
    assert err <= bound, f"max abs error {err:.3g} > {bound:.3g} (rel {rel})"


def same_bits_on_every_path_and_thread_count(kernels: list, xs: tuple[torch.Tensor, ...]) -> bool:
    """Whether each kernel (a callable x -> y: one per path) gives bit-identical outputs for each x at 1 and
    2 threads."""
    threads = torch.get_num_threads()
    try:
        for x in xs:
            ys = []
            for kernel in kernels:
                for n in (1, 2):
                    torch.set_num_threads(n)
                    ys.append(kernel(x))
            if not all(torch.equal(ys[0], y) for y in ys):
                return False
    finally:
        torch.set_num_threads(threads)
    return True


def random_w4a16(
    num_rows: int, in_features: int, group_size: int, gen: torch.Generator, num_experts: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`weight_packed` int32 `[(E,) N, K/8]`, `weight_scale` bf16 `[(E,) N, K/G]`) of random q in -8..7."""
    experts = num_experts or 1
    q = torch.randint(-8, 8, (experts, num_rows, in_features), generator=gen, dtype=torch.int8)
    packed = torch.stack([pack_int4(q_e) for q_e in q])  # [E, N, K/8]
    scale = (
        (torch.rand(experts, num_rows, in_features // group_size, generator=gen) + 0.5) / 8 / in_features**0.5
    )
    scale = scale.to(torch.bfloat16)
    return (packed, scale) if num_experts else (packed[0], scale[0])


@dataclass
class PagedKV:
    """A paged K/V cache with its tables, scales and the real (unquantized) K/V of each sequence."""

    k_cache: torch.Tensor  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32
    k_scale: torch.Tensor  # [] or [Hkv] fp32
    v_scale: torch.Tensor
    k_real: list[torch.Tensor]  # per sequence [L, Hkv, D] fp32 values the cache encodes
    v_real: list[torch.Tensor]

    def cache(self, backend: str | None = None) -> PagedKVCache:
        return PagedKVCache.of(self.k_cache, self.v_cache, self.k_scale, self.v_scale, backend=backend)

    @property
    def tables(self) -> DecodeTables:
        return DecodeTables(self.block_tables, self.seq_lens)


def bf16_weight(packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """bf16(q * scale) `[N, K]`: q * scale is exact in fp32, rounded once (compressed-tensors' weight; the
    amx path and avx512bf16's vdpbf16ps GEMM multiply it)."""
    from kvq.runtime.kernels.w4a16 import w4a16_reference

    return w4a16_reference(torch.eye(packed.shape[1] * 8), packed, scale, group_size).t().bfloat16()


def _scale_for(values: torch.Tensor, is_per_head: bool) -> torch.Tensor:
    amax = values.abs().amax(dim=(0, 2)) if is_per_head else values.abs().amax()
    return (amax / FP8_E4M3_MAX).float()


def paged_values(
    seq_lens: list[int], page_size: int, row_shape: tuple[int, ...], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(values `[num_pages, page_size, *row_shape]` with NaN in every slot no sequence owns, block_tables
    int32 `[B, max_pages]`, each sequence's values `[L, *row_shape]`): sequences on shuffled pages with 2
    spare pages, seq 1 sharing seq 0's first full page, table padding of -1 and garbage."""
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq) + 2
    perm = torch.randperm(num_pages, generator=gen)
    block_tables = torch.full((len(seq_lens), max(pages_per_seq) + 2), -1, dtype=torch.int32)
    block_tables[::2, -1] = 10**6  # padding may be garbage, not only -1
    real = torch.full((num_pages, page_size, *row_shape), float("nan"))
    per_seq, used = [], 0
    for b, (seq_len, num) in enumerate(zip(seq_lens, pages_per_seq, strict=True)):
        pages = perm[used : used + num].clone()
        used += num
        if b == 1 and num and pages_per_seq[0] and seq_lens[0] >= page_size:
            pages[0] = block_tables[0, 0]  # prefix sharing: same full first page
        block_tables[b, :num] = pages.to(torch.int32)
        fresh = torch.randn(seq_len, *row_shape, generator=gen) * 2
        dense = real[pages].flatten(0, 1)  # [num * page_size, *row_shape]
        dense[:seq_len] = torch.where(torch.isnan(dense[:seq_len]), fresh, dense[:seq_len])
        real[pages] = dense.view(num, page_size, *row_shape)
        per_seq.append(dense[:seq_len].clone())
    return real, block_tables, per_seq


def random_paged_kv(
    seq_lens: list[int],
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    cache_dtype: torch.dtype,
    is_per_head: bool,
    gen: torch.Generator,
) -> PagedKV:
    """Sequences on shuffled pages (`paged_values`), NaN in unowned slots; K and V of each."""
    real, block_tables, per_seq = paged_values(seq_lens, page_size, (num_kv_heads, head_dim, 2), gen)
    k_real, v_real = [v[..., 0] for v in per_seq], [v[..., 1] for v in per_seq]
    owned = (
        torch.cat(k_real + v_real) if seq_lens and sum(seq_lens) else torch.ones(1, num_kv_heads, head_dim)
    )
    k_scale = _scale_for(owned, is_per_head)
    v_scale = _scale_for(owned, is_per_head) * 1.25
    if cache_dtype == torch.float8_e4m3fn:
        shape = (1, 1, -1, 1) if is_per_head else ()
        k_cache = (real[..., 0] / k_scale.view(shape)).to(cache_dtype)
        v_cache = (real[..., 1] / v_scale.view(shape)).to(cache_dtype)
    else:
        k_cache, v_cache = real[..., 0].to(cache_dtype), real[..., 1].to(cache_dtype)
    return PagedKV(
        k_cache,
        v_cache,
        block_tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        k_scale,
        v_scale,
        k_real,
        v_real,
    )


@dataclass
class PagedLatent:
    """One MLA layer's latent pages (views of the pool's slot bytes, index keys beside them), tables, the
    scale, and the real (unquantized) rows of each sequence."""

    cache: PagedLatentCache
    block_tables: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32
    rows: list[torch.Tensor]  # per sequence [L, R + rope] fp32 values the pages encode

    @property
    def tables(self) -> DecodeTables:
        return DecodeTables(self.block_tables, self.seq_lens)


def random_paged_latent(
    seq_lens: list[int],
    page_size: int,
    kv_lora_rank: int,
    rope_dim: int,
    cache_dtype: torch.dtype,
    gen: torch.Generator,
    index_head_dim: int = 0,
) -> PagedLatent:
    """Sequences on shuffled pages of a `LatentLayout` pool (strided slots when index_head_dim > 0), as in
    `random_paged_kv`: 2 spare pages, seq 1 sharing seq 0's first page, NaN in every unowned slot."""
    layout = LatentLayout(kv_lora_rank, rope_dim, cache_dtype, index_head_dim)
    real, block_tables, rows = paged_values(seq_lens, page_size, (kv_lora_rank + rope_dim,), gen)
    latent, _ = layout.views(layout.allocate(1, real.shape[0], page_size, torch.device("cpu"))[0])
    owned = torch.cat(rows) if sum(seq_lens) else torch.ones(1)
    k_scale = (owned.abs().amax() / FP8_E4M3_MAX).float()
    latent.copy_(
        (real / k_scale).to(cache_dtype) if cache_dtype == torch.float8_e4m3fn else real.to(cache_dtype)
    )
    cache = PagedLatentCache.of(latent, kv_lora_rank, k_scale, None)
    return PagedLatent(cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), rows)


def random_selection(seq_lens: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """DSA-like `[B, k]` int32 positions: a random subset of each sequence (all of a short one), -1 padded."""
    rows = []
    for n in seq_lens.tolist():
        chosen = torch.randperm(n, generator=gen)[:k]
        rows.append(torch.cat([chosen, torch.full((k - chosen.numel(),), -1)]))
    return torch.stack(rows).to(torch.int32)


def case_id(value: object) -> str | None:
    """A parametrize id for a case NamedTuple: its values, e.g. `16-2-2-64-float8_e4m3fn-True-float16`."""
    if not isinstance(value, tuple):
        return None
    return "-".join(str(v).removeprefix("torch.") for v in value)
