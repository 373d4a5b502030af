"""The engine's settings: one flat dataclass, validated on creation, whose defaults the CLI reads.

Imports kvq.byte_sizes, kvq.kv_cache_dtypes and kvq.errors only; torch and psutil when a property asks,
so a command line validates its flags before torch loads. A refusal names the flag (`--page-size`), the
value and the choices.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvq.byte_sizes import parse_bytes
from kvq.errors import KvqError
from kvq.kv_cache_dtypes import AUTO, BF16, FP8_E4M3, check_dtype, check_kv_cache_dtype

if TYPE_CHECKING:
    import torch

KV_TORCH_DTYPES = {BF16: "bfloat16", FP8_E4M3: "float8_e4m3fn"}  # names: kvq.kv_cache_dtypes
FP8_WEIGHT_MODES = ("per-use", "bf16")
LM_HEAD_WEIGHT_MODES = ("stored", "int8", "int4")
INT4_COMPUTE_MODES = ("w4a16", "w4a8")
LM_HEAD_GROUP_SIZE = 32  # the int4 copy's group size: the finest the kernels run
DEVICES = ("auto", "cpu", "cuda")
KV_INTEGRITY_MODES = ("off", "tags", "full")


@dataclass
class EngineConfig:
    """Everything the engine needs besides the requests. Invalid values raise `KvqError` at creation.

    dtype: activation dtype. "auto" is bfloat16 (the fast path: INT4 weights run through the CPU int4 op);
      "float32" is the reference mode: every weight dequantized to fp32, KV pages fp32 unless set.
    kv_cache_dtype: "auto" is fp8_e4m3 when the checkpoint has a `kv_cache_scheme` (calibrated scales),
      else the activation dtype; "bf16" / "fp8_e4m3" force it (names as in vLLM / SGLang).
    kv_memory: bytes for the KV pool ("512MiB", "2GB" = 2 * 10^9 or an integer: `kvq.byte_sizes`); unset:
      kv_memory_fraction of the free memory of the device.
    decode_reserve_ratio: a request is admitted only when its prompt pages plus this fraction of the
      pages its remaining max_tokens may need (for it and every running request) are free. 1.0 never
      preempts a request that runs to max_tokens; 0.0 admits on prompt pages alone (vLLM) and relies on
      preemption by recompute when decode runs out of pages.
    fp8_weights: FP8-block weights dequantized at every use ("per-use", memory as stored) or once at
      load to BF16 ("bf16", faster, twice the memory).
    lm_head_weights: "stored" runs the lm_head as the checkpoint stores it (a tied embedding: dense);
      "int8" makes a runtime W8A16 copy (a scale per row, round to nearest) of a dense lm_head at load,
      "int4" a W4A16 one (group 32), so the largest matmul of a small model's decode step reads a half or
      a quarter of the bytes (opt-in: each costs some quality, `kvq eval --lm-head-weights int8`
      measures how much). Not in reference mode.
    int4_compute: how INT4 Linears multiply on CPU. "w4a16" (default) multiplies the 16-bit activations;
      "w4a8" quantizes them to int8 per row and 64 inputs (symmetric, round to nearest) and sums in exact
      integers on AVX-512 VNNI or AVX2 (`kernels.w4a8_cpu`): faster batches and GEMVs that keep up with
      memory, for some quality (opt-in: `kvq eval --int4-compute w4a8` measures it). Every INT4 Linear,
      stacked MoE experts too; not in reference mode, nor off CPU. The lm_head's runtime
      copies follow it: "int4" runs as W4A8, "int8" as W8A8 (bf16 row scales; K a multiple of 32).
    kv_integrity: checked KV pages (`kvq.runtime.integrity`). "off" builds no tracker and does no work;
      "tags" checks, once per step before any page is read, that every page a request reads or writes
      carries the tag its own state expects; "full" also re-hashes sampled bytes of every sealed page
      read. A failed check ends only the request it hit (finish reason "error").
    enforce_eager: run every decode step through the layers' Python (as vLLM's enforce_eager keeps CUDA
      graphs off); by default CPU decode steps of Llama and GLM-4.5 layers replay one list of C calls bound
      once per batch size (`kvq.runtime.decode_plan`), the same values without the per-op Python.
    tp: tensor-parallel ranks (`kvq.runtime.distributed`): one device each, gloo on CPU, NCCL on CUDA;
      kvq starts the other ranks itself, or joins the ranks torchrun started (WORLD_SIZE must equal tp).
    """

    model: str
    dtype: str = "auto"
    kv_cache_dtype: str = AUTO
    page_size: int = 16
    kv_memory: str | int | None = None
    kv_memory_fraction: float = 0.3
    require_kv_scales: bool = False
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    decode_reserve_ratio: float = 1.0
    enable_prefix_caching: bool = True
    fp8_weights: str = "per-use"
    device: str = "auto"
    threads: int | None = None
    kv_integrity: str = "off"
    lm_head_weights: str = "stored"
    int4_compute: str = "w4a16"
    tp: int = 1
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if not Path(self.model).is_dir():
            raise KvqError(f"{self.model}: no such model directory; pass a checkpoint directory")
        self.dtype = check_dtype(self.dtype)
        self.kv_cache_dtype = check_kv_cache_dtype(self.kv_cache_dtype)
        _choice("fp8_weights", self.fp8_weights, FP8_WEIGHT_MODES)
        _choice("device", self.device, DEVICES)
        _choice("kv_integrity", self.kv_integrity, KV_INTEGRITY_MODES)
        _choice("lm_head_weights", self.lm_head_weights, LM_HEAD_WEIGHT_MODES)
        if self.lm_head_weights != "stored" and self.is_reference:
            raise KvqError(
                f"--lm-head-weights {self.lm_head_weights} quantizes the lm_head, but --dtype float32 is the "
                "reference mode (every weight dense fp32); use --dtype auto, or --lm-head-weights stored"
            )
        _choice("int4_compute", self.int4_compute, INT4_COMPUTE_MODES)
        if self.int4_compute == "w4a8":
            self._check_w4a8()
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "tp"):
            if getattr(self, name) < 1:
                raise KvqError(f"{_flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise KvqError(f"--max-model-len must be >= 2 tokens, got {self.max_model_len}")
        if not 0.0 < self.kv_memory_fraction <= 0.95:
            raise KvqError(f"kv_memory_fraction must be in (0, 0.95], got {self.kv_memory_fraction}")
        if not 0.0 <= self.decode_reserve_ratio <= 1.0:
            raise KvqError(f"decode_reserve_ratio must be in [0, 1], got {self.decode_reserve_ratio}")
        if self.threads is not None and self.threads < 1:
            raise KvqError(f"--threads must be >= 1, got {self.threads}")
        if self.kv_memory is not None:
            self.kv_memory = parse_bytes(self.kv_memory, "--kv-memory")
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise KvqError("--device cuda was requested but torch sees no CUDA device; use --device cpu")

    def _check_w4a8(self) -> None:
        from kvq.runtime.kernels.w4a8_cpu import w4a8_path

        if self.is_reference:
            raise KvqError(
                "--int4-compute w4a8 quantizes activations, but --dtype float32 is the reference mode; use "
                "--dtype auto, or --int4-compute w4a16"
            )
        if self.torch_device.type != "cpu":
            raise KvqError("--int4-compute w4a8 is a CPU kernel; use --device cpu, or --int4-compute w4a16")
        if w4a8_path() is None:
            raise KvqError(
                "--int4-compute w4a8 needs kvq's CPU extension and a SIMD CPU path ($KVQ_CPU_ISA auto, amx, "
                "avx512bf16, avx512 or avx2: AVX2 at least); this build or setting has neither: use "
                "--int4-compute w4a16"
            )

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def activation_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, "bfloat16" if self.dtype == "auto" else self.dtype)

    @property
    def is_reference(self) -> bool:
        """fp32 reference mode: weights dequantized to fp32, meant to match transformers' fp32 forward."""
        return self.dtype == "float32"

    def kv_torch_dtype(self, has_kv_cache_scheme: bool) -> torch.dtype:
        """The KV page dtype: the explicit choice, else FP8 for calibrated checkpoints, else activations."""
        import torch

        if self.kv_cache_dtype != AUTO:
            return getattr(torch, KV_TORCH_DTYPES[self.kv_cache_dtype])
        return torch.float8_e4m3fn if has_kv_cache_scheme else self.activation_dtype

    def kv_pool_bytes(self) -> int:
        """The KV pool budget: `kv_memory`, else `kv_memory_fraction` of the device's free memory."""
        if self.kv_memory is not None:
            return int(self.kv_memory)
        import psutil
        import torch

        device = self.torch_device
        free = (
            torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
        )
        return int(free * self.kv_memory_fraction)


def _flag(name: str) -> str:
    """The command-line flag that sets field `name` (a --config file's engine key is the field name)."""
    return "--" + name.replace("_", "-")


def _choice(name: str, value: str, choices: Collection[str]) -> None:
    if value not in choices:
        raise KvqError(f"{_flag(name)} {value!r}: pick one of {', '.join(choices)}")
