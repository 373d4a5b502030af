"""Backend choice (argument > $KVQ_KERNELS > auto) and the Triton-free import of kvq.runtime.kernels."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvq.errors import KvqError
from kvq.runtime.kernels import KVQ_KERNELS_ENV, prepare_w4a16, resolve_backend, store_kv, w4a16_linear
from tests.runtime.kernels.kernel_cases import random_w4a16

CPU = torch.device("cpu")


def test_auto_is_torch_on_cpu_and_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KVQ_KERNELS_ENV, raising=False)
    assert resolve_backend(CPU) == "torch"
    assert resolve_backend(torch.device("cuda")) == "triton"  # triton is installed here


def test_env_then_argument_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KVQ_KERNELS_ENV, "triton")
    assert resolve_backend(CPU) == "triton"
    assert resolve_backend(CPU, "torch") == "torch"
    gen = torch.Generator().manual_seed(0)
    w = prepare_w4a16(*random_w4a16(32, 64, 32, gen), 32)
    assert w.backend == "triton" and w.weight_packed is not None
    monkeypatch.setenv(KVQ_KERNELS_ENV, "cuda")
    with pytest.raises(KvqError, match="KVQ_KERNELS"):
        resolve_backend(CPU)


def test_forced_triton_on_cpu_runs_interpreted_and_agrees_with_torch() -> None:
    gen = torch.Generator().manual_seed(1)
    packed, scale = random_w4a16(48, 128, 64, gen)
    x = torch.randn(2, 128, generator=gen).to(torch.bfloat16)
    by_torch = w4a16_linear(x, prepare_w4a16(packed, scale, 64, backend="torch"))
    by_triton = w4a16_linear(x, prepare_w4a16(packed, scale, 64, backend="triton"))
    torch.testing.assert_close(by_triton, by_torch, rtol=2e-2, atol=2e-2 * by_torch.abs().max().item())
    caches = [torch.zeros(3, 4, 2, 64, dtype=torch.float8_e4m3fn) for _ in range(4)]
    k = torch.randn(5, 2, 64, generator=gen)
    slots = torch.tensor([0, 5, -1, 11, 2])
    store_kv(k, k, caches[0], caches[1], slots, 0.01, 0.02, backend="torch")
    store_kv(k, k, caches[2], caches[3], slots, 0.01, 0.02, backend="triton")
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))


def test_package_imports_and_runs_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "import kvq.runtime.kernels as k\n"
        "assert k.resolve_backend(torch.device('cuda')) == 'torch'\n"
        "q = torch.randn(1, 2, 64); c = torch.zeros(2, 4, 1, 64, dtype=torch.bfloat16)\n"
        "k.paged_decode_attention(q, c, c, torch.tensor([[0]], dtype=torch.int32), torch.tensor([3]))\n"
        "assert not any(m == 'triton' or m.startswith('triton.') for m in sys.modules if sys.modules[m])\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_interpreted_launches_leave_triton_language_unpatched() -> None:
    import triton.language as tl

    before = {name: value for name, value in vars(tl.core).items() if callable(value)}
    gen = torch.Generator().manual_seed(2)
    packed, scale = random_w4a16(
        40, 256, 32, gen
    )  # split-K launch: the kernel calls tl.cdiv, a @jit function
    w4a16_linear(torch.randn(3, 256, generator=gen), prepare_w4a16(packed, scale, 32, backend="triton"))
    after = {name: value for name, value in vars(tl.core).items() if callable(value)}
    assert [name for name in before if after.get(name) is not before[name]] == []
