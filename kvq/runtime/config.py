"""The engine's settings: one flat dataclass, validated on creation, that declares the engine options of
every command (default and help text) and the keys of a --config file's `engine` section.

Imports kvq.byte_sizes, kvq.kv_cache_dtypes, kvq.runtime.kernel_choices and kvq.errors only; torch and
psutil when a property asks, so a command line validates its flags before torch loads. A refusal names
the flag (`--page-size`), the value and the choices.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvq.byte_sizes import SIZE_HELP, parse_bytes
from kvq.errors import KvqError
from kvq.kv_cache_dtypes import (
    AUTO,
    BF16,
    FP8_E4M3,
    KV_CACHE_DTYPE_HELP,
    check_dtype,
    check_kv_cache_dtype,
)
from kvq.runtime.kernel_choices import BACKEND_CHOICES, CPU_ISA_CHOICES

if TYPE_CHECKING:
    import torch

KV_TORCH_DTYPES = {BF16: "bfloat16", FP8_E4M3: "float8_e4m3fn"}  # names: kvq.kv_cache_dtypes
FP8_WEIGHT_MODES = ("per-use", "bf16")
LM_HEAD_WEIGHT_MODES = ("auto", "stored", "int8", "int4")
INT4_COMPUTE_MODES = ("w4a16", "w4a8")
LM_HEAD_GROUP_SIZE = 32  # the int4 copy's group size: the finest the kernels run
DEVICES = ("auto", "cpu", "cuda")
KV_INTEGRITY_MODES = ("off", "tags", "full")
SPECULATIVE_METHODS = ("mtp",)  # --speculative: drafts from the checkpoint's MTP (NextN) layers


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A settings field that is also a command-line option: its default, its --help text, and optionally
    `check` (a callable that validates and normalizes the value as typed) and `envvar`."""
    return field(default=default, metadata={"help": help, **metadata})


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
      a quarter of the bytes (`kvq eval --lm-head-weights int8` measures the cost: SmolLM2 perplexity
      unchanged, KL +0.002; int4 costs more). "auto" (default, `lm_head_mode`): int8 for a lm_head tied
      to the embedding on CPU (batches of 12+ rows still run on the embedding), else stored. Not in
      reference mode.
    int4_compute: how INT4 Linears multiply on CPU. "w4a16" (default) multiplies the 16-bit activations;
      "w4a8" quantizes them to int8 per row and 64 inputs (symmetric, round to nearest) and sums in exact
      integers on AVX-512 VNNI or AVX2 (`kernels.cpu.w4a8`): faster batches and GEMVs that keep up with
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
    # a field made by `option` is also the command-line option --field-name of kvq generate, serve, eval and
    # bench (`kvq.commands.field_options`); the others a --config file sets (`ENGINE_KEYS`: all of them)
    dtype: str = option(
        "auto",
        "Activations: auto (bfloat16), bfloat16 (or bf16) or float32 (or fp32: the reference mode, weights "
        "dequantized).",
        check=check_dtype,
    )
    kv_cache_dtype: str = option(AUTO, KV_CACHE_DTYPE_HELP, check=check_kv_cache_dtype)
    page_size: int = option(16, "Tokens per KV page.")
    kv_memory: str | int | None = option(
        None, f"KV pool size, e.g. 512MiB (default: a fraction of free memory). {SIZE_HELP}"
    )
    kv_memory_fraction: float = 0.3
    require_kv_scales: bool = option(False, "Fail instead of warning when FP8 KV has no calibrated scales.")
    max_num_seqs: int = option(128, "Most requests decoded together; the rest wait for KV pages.")
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = option(
        None, "Context length in tokens (default: the model's max_position_embeddings)."
    )
    decode_reserve_ratio: float = 1.0
    enable_prefix_caching: bool = True
    fp8_weights: str = "per-use"
    device: str = "auto"
    threads: int | None = option(None, "torch CPU threads.")
    cpu_isa: str | None = option(
        None,
        "CPU kernel path: auto (the fastest this CPU runs: amx, avx512bf16, avx512 or avx2), one of those, "
        "scalar (kvq's C reference) or torch (torch's own ops throughout). Chosen once, at load. "
        "Default: $KVQ_CPU_ISA, else auto.",
        envvar="KVQ_CPU_ISA",
    )
    kernels: str | None = option(
        None,
        "Kernel backend: auto (Triton for CUDA tensors where Triton is installed, else torch), torch or "
        "triton (on CPU tensors Triton's interpreter: slow, for tests). Chosen once, at load. Default: "
        "$KVQ_KERNELS, else auto.",
        envvar="KVQ_KERNELS",
    )
    kv_integrity: str = option(
        "off",
        "Checked KV pages: off (no checks, no cost); tags (before each step's attention, every page the "
        "request reads or writes must carry the tag its own tokens and allocations expect: catches freed, "
        "reused, misdirected and stale pages); full (tags, plus a hash of sampled bytes of every full page, "
        "taken when it was written: catches bytes changed in place). A failed check stops the request with "
        "an error naming the page.",
    )
    lm_head_weights: str = option(
        "auto",
        "auto (int8 for a lm_head tied to the embedding on CPU, else stored), stored (the lm_head as the "
        "checkpoint has it; a tied embedding stays BF16), int8 (a W8A16 copy made at load, a scale per row) "
        "or int4 (W4A16, group 32): faster decode on CPU for some quality cost (int4 more than int8): "
        "measure it with kvq eval.",
    )
    int4_compute: str = option(
        "w4a16",
        "How INT4 Linears multiply on CPU: w4a16 (the 16-bit activations, exact) or w4a8 (activations "
        "quantized to int8 per row and 64 inputs, exact integer sums on AVX-512 VNNI: faster batches and "
        "decode for some quality; measure it with kvq eval). Stacked MoE experts too; an INT8 lm_head copy "
        "runs as w8a8.",
    )
    tp: int = option(
        1,
        "Tensor-parallel ranks, one device each (gloo on CPU, NCCL on CUDA). kvq starts the other ranks "
        "itself, or runs under torchrun (then WORLD_SIZE must equal --tp). Heads, MLP/expert intermediate "
        "size and vocabulary must split evenly (INT4 on group, FP8 on block boundaries).",
    )
    enforce_eager: bool = option(
        False,
        "Run every decode step through the layers' Python (as vLLM's --enforce-eager keeps CUDA graphs "
        "off). Default: CPU decode of Llama and GLM-4.5 models replays one list of C calls bound once per "
        "batch size, the same values without the per-op Python.",
    )

    speculative: str | None = option(
        None,
        "Speculative decoding: mtp drafts tokens with the checkpoint's MTP (NextN) layer and verifies them "
        "in one forward of the model (glm_moe_dsa, deepseek_v3 with num_nextn_predict_layers >= 1); the "
        "output is the model's own (greedy: the same tokens; sampling: the same distribution).",
    )
    num_speculative_tokens: int = option(1, "Tokens the MTP layer drafts per step with --speculative mtp.")

    def __post_init__(self) -> None:
        if not Path(self.model).is_dir():
            raise KvqError(f"{self.model}: no such model directory; pass a checkpoint directory")
        self.dtype = check_dtype(self.dtype)
        self.kv_cache_dtype = check_kv_cache_dtype(self.kv_cache_dtype)
        _choice("fp8_weights", self.fp8_weights, FP8_WEIGHT_MODES)
        if self.kernels is not None:
            self.kernels = self.kernels.strip().lower() or "auto"
            _choice("kernels", self.kernels, BACKEND_CHOICES)
        if self.cpu_isa is not None:
            value, self.cpu_isa = self.cpu_isa, self.cpu_isa.strip().lower() or "auto"
            if self.cpu_isa not in CPU_ISA_CHOICES:
                raise KvqError(
                    f"--cpu-isa (or $KVQ_CPU_ISA) is {value!r}; pick one of {', '.join(CPU_ISA_CHOICES)}"
                )
        _choice("device", self.device, DEVICES)
        _choice("kv_integrity", self.kv_integrity, KV_INTEGRITY_MODES)
        _choice("lm_head_weights", self.lm_head_weights, LM_HEAD_WEIGHT_MODES)
        if self.lm_head_weights not in ("auto", "stored") and self.is_reference:
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
        if self.speculative is not None:
            _choice("speculative", self.speculative, SPECULATIVE_METHODS)
        if self.num_speculative_tokens < 1:
            raise KvqError(f"--num-speculative-tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise KvqError("--device cuda was requested but torch sees no CUDA device; use --device cpu")

    def _check_w4a8(self) -> None:
        from kvq.runtime.kernels.cpu.isa import resolve_cpu_isa
        from kvq.runtime.kernels.cpu.w4a8 import w4a8_path

        if self.is_reference:
            raise KvqError(
                "--int4-compute w4a8 quantizes activations, but --dtype float32 is the reference mode; use "
                "--dtype auto, or --int4-compute w4a16"
            )
        if self.torch_device.type != "cpu":
            raise KvqError("--int4-compute w4a8 is a CPU kernel; use --device cpu, or --int4-compute w4a16")
        if w4a8_path(resolve_cpu_isa(self.cpu_isa)) is None:
            raise KvqError(
                "--int4-compute w4a8 needs kvq's CPU extension and a SIMD CPU path (--cpu-isa auto, amx, "
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


def option_names(settings: type) -> tuple[str, ...]:
    """The fields of the settings dataclass `settings` made by `option`, in declaration order."""
    return tuple(f.name for f in fields(settings) if "help" in f.metadata)


ENGINE_KEYS = tuple(f.name for f in fields(EngineConfig) if f.name != "model")  # --config's engine keys
ENGINE_OPTIONS = option_names(EngineConfig)  # the command-line options among them


def _flag(name: str) -> str:
    """The command-line flag that sets field `name` (a --config file's engine key is the field name)."""
    return "--" + name.replace("_", "-")


def _choice(name: str, value: str, choices: Collection[str]) -> None:
    if value not in choices:
        raise KvqError(f"{_flag(name)} {value!r}: pick one of {', '.join(choices)}")


def lm_head_mode(config: EngineConfig, is_tied: bool) -> str:
    """What `lm_head_weights` means for this model: "auto" is int8 where the lm_head is the tied embedding
    (its BF16 weight stays resident for the embedding: the copy costs 1/2 of it and no quality within
    `kvq eval`'s noise) on CPU outside reference mode, else stored."""
    if config.lm_head_weights != "auto":
        return config.lm_head_weights
    is_cpu = config.torch_device.type == "cpu"
    return "int8" if is_tied and is_cpu and not config.is_reference else "stored"
