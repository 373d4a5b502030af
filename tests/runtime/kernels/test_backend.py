"""Backend choice (argument > $KVQ_KERNELS > auto), the Triton-free import of kvq.runtime.kernels, and
Triton on CPU tensors only under Triton's own interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvq.errors import KvqError
from kvq.runtime.kernels import KVQ_KERNELS_ENV, PagedKVCache, prepare_w4a16, resolve_backend, w4a16_linear
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
    PagedKVCache.of(caches[0], caches[1], 0.01, 0.02, backend="torch").store(k, k, slots)
    PagedKVCache.of(caches[2], caches[3], 0.01, 0.02, backend="triton").store(k, k, slots)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))


def test_package_imports_and_runs_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "import kvq.runtime.kernels as k\n"
        "assert k.resolve_backend(torch.device('cuda')) == 'torch'\n"
        "q = torch.randn(1, 2, 64); c = torch.zeros(2, 4, 1, 64, dtype=torch.bfloat16)\n"
        "tables = k.DecodeTables(torch.tensor([[0]], dtype=torch.int32), torch.tensor([3]))\n"
        "k.PagedKVCache.of(c, c).decode_attention(q, tables)\n"
        "assert not any(m == 'triton' or m.startswith('triton.') for m in sys.modules if sys.modules[m])\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error() -> None:
    # kvq patches nothing of Triton's: CPU tensors need TRITON_INTERPRET=1 at triton's first import
    code = (
        "import torch\n"
        "from kvq.errors import KvqError\n"
        "from kvq.runtime.kernels import PagedKVCache\n"
        "c = torch.zeros(2, 4, 1, 64, dtype=torch.bfloat16); k = torch.randn(1, 1, 64)\n"
        "try:\n"
        "    PagedKVCache.of(c, c, backend='triton').store(k, k, torch.tensor([0]))\n"
        "except KvqError as e:\n"
        "    print(e)\n"
    )
    env = os.environ | {"TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "store_kv_kernel got cpu tensors" in result.stdout and "TRITON_INTERPRET=1" in result.stdout


def test_the_engine_chooses_its_backend_once_from_its_setting(int4_checkpoint, monkeypatch) -> None:
    """--kernels (EngineConfig.kernels) wins over $KVQ_KERNELS, is checked at creation, and is resolved once
    by the loader: every prepared weight and KV cache carries it; a later change of the variable changes
    nothing."""
    from kvq.runtime.config import EngineConfig
    from kvq.runtime.engine import Engine
    from kvq.runtime.sampling import SamplingParams

    model = str(int4_checkpoint("llama"))
    with pytest.raises(KvqError, match="--kernels 'cuda': pick one of auto, torch, triton"):
        EngineConfig(model=model, kernels="cuda")
    monkeypatch.setenv(KVQ_KERNELS_ENV, "triton")
    engine = Engine(EngineConfig(model=model, kv_memory="4MiB", kernels=" Torch"))
    layer = engine.model.layers[0]
    assert engine.config.kernels == "torch" and engine.model.backend == "torch"
    assert layer.self_attn.qkv_proj.weight.backend == "torch" and layer.self_attn.attn.kv.backend == "torch"
    monkeypatch.setenv(KVQ_KERNELS_ENV, "bogus")  # read at load only
    out = engine.generate([[5, 17, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
