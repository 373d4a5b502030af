"""Every launcher's exact launch (W4A16, fused MoE, KV store, GQA and MLA latent decode), compiled for
sm_90 (H100/H200) on a CPU machine with Triton's bundled ptxas: `python -m
tests.runtime.kernels.sm90_launches` prints one JSON line per launch (kernel name, whether its PTX uses
tensor cores). Run by test_compile_sm90.py in its own process with TRITON_INTERPRET=0, since the test
process interprets every kernel (tests/conftest.py).

A recorder stands in for the kernel, captures the launcher's arguments, and they are specialised as
Triton's JIT does (ints == 1 become constants, 16-divisible ints and pointers get tt.divisibility).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.interpreter import InterpretedFunction

from kvq.runtime.kernels import PagedKVCache
from kvq.runtime.kernels.paged.latent_cache import PagedLatentCache
from kvq.runtime.kernels.triton import fused_moe as fused_moe_triton
from kvq.runtime.kernels.triton import kv_store as kv_store_triton
from kvq.runtime.kernels.triton import latent_attention as latent_attention_triton
from kvq.runtime.kernels.triton import paged_attention as paged_attention_triton
from kvq.runtime.kernels.triton import w4a16 as w4a16_triton
from kvq.runtime.kernels.w4a16 import compressed_tensors_weight
from tests.runtime.kernels.kernel_cases import random_paged_kv, random_paged_latent, random_w4a16

H100 = GPUTarget("cuda", 90, 32)
_TYPES = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
    torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.uint8: "u8",
}  # fmt: skip


class Recorder:
    """`kernel[grid](*args, **kwargs)` that records the launch instead of running it."""

    def __init__(self, kernel: Any, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def compile_launch(kernel: Any, args: tuple, kwargs: dict) -> Any:
    """Compile one recorded launch for sm_90 the way the JIT would specialise it (tuples element-wise)."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
    constexprs: dict = {}
    attrs: dict = {}

    def specialise(path: tuple[int, ...], value: Any, is_constexpr: bool) -> Any:
        if isinstance(value, tuple) and not is_constexpr:
            return tuple(specialise((*path, j), item, False) for j, item in enumerate(value))
        if is_constexpr or value is None or (isinstance(value, int) and value == 1):
            constexprs[path] = value
            return "constexpr"
        if isinstance(value, torch.Tensor):
            attrs[path] = [["tt.divisibility", 16]] if value.data_ptr() % 16 == 0 else []
            return "*" + _TYPES[value.dtype]
        if isinstance(value, float):
            return "fp32"
        attrs[path] = [["tt.divisibility", 16]] if value % 16 == 0 else []
        return "i32" if -(2**31) <= value < 2**31 else "i64"

    signature = {
        name: specialise((i,), values[name], param.is_constexpr)
        for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params, strict=True))
    }
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=H100, options=options)


def record_launches() -> list:
    """Every launcher's launches on odd shapes (bf16, fp8 and bf16 pages, decode and prefill GEMMs)."""
    launches: list = []
    for module in (
        w4a16_triton,
        fused_moe_triton,
        kv_store_triton,
        paged_attention_triton,  # the decode attention launchers' `plan_decode`
    ):
        module.kernel_for = lambda kernel, device: Recorder(kernel, launches)  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16
    weight = compressed_tensors_weight("triton", *random_w4a16(4096, 1024, 128, gen), 128)
    for num_rows in (1, 32, 300):
        w4a16_triton.w4a16_linear_triton(torch.randn(num_rows, 1024).to(bf16), weight)
    w13 = compressed_tensors_weight("triton", *random_w4a16(256, 512, 128, gen, num_experts=8), 128)
    w2 = compressed_tensors_weight("triton", *random_w4a16(512, 128, 128, gen, num_experts=8), 128)
    topk_ids = torch.randint(0, 8, (3, 2), generator=gen)
    fused_moe_triton.fused_moe_triton(torch.randn(3, 512).to(bf16), topk_ids, torch.rand(3, 2), w13, w2)
    for cache_dtype, num_splits in ((torch.float8_e4m3fn, 3), (bf16, 1)):
        kv = random_paged_kv([300, 17], 16, 2, 128, cache_dtype, True, gen)
        q = torch.randn(2, 16, 128).to(bf16)
        cache = PagedKVCache.of(kv.k_cache, kv.v_cache, kv.k_scale, kv.v_scale, backend="triton")
        paged_attention_triton.paged_decode_attention_triton(q, cache, kv.tables, num_splits=num_splits)
        k = torch.randn(5, 2, 128).to(bf16)
        kv_store_triton.store_kv_triton(k, k, cache, torch.arange(5))
        latent = random_paged_latent([300, 17], 16, 512, 64, cache_dtype, gen, index_head_dim=128)
        q = torch.randn(2, 16, 576).to(bf16)
        latent_cache = PagedLatentCache.of(
            latent.cache.latent_cache, 512, latent.cache.k_scale, backend="triton"
        )
        indices = torch.arange(64, dtype=torch.int32).expand(2, 64).contiguous() if num_splits == 1 else None
        tables = latent.tables._replace(token_indices=indices)
        latent_attention_triton.latent_decode_attention_triton(
            q, latent_cache, tables, 0.1, num_splits=num_splits
        )
    return launches


def main() -> None:
    if isinstance(w4a16_triton.w4a16_kernel, InterpretedFunction):
        raise SystemExit("TRITON_INTERPRET=1 was set before the kernels were decorated: nothing to compile")
    for kernel, args, kwargs in record_launches():
        compiled = compile_launch(kernel, args, dict(kwargs))
        print(json.dumps({"kernel": kernel.__name__, "mma": "mma" in compiled.asm["ptx"]}), flush=True)


if __name__ == "__main__":
    main()
