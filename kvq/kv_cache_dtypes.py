"""The dtype vocabulary of every command: `--kv-cache-dtype` as vLLM names it (`auto`, `bf16`,
`fp8_e4m3`) and `--dtype` (`auto`, `bfloat16`, `float32`), each taking the other's spellings too
(`bfloat16` or `bf16`, `float32` or `fp32`, `fp8` for `fp8_e4m3`, as vLLM's `--kv-cache-dtype fp8`), and
giving back the name above.

`auto` is FP8 e4m3 when the checkpoint carries calibrated scales (a `kv_cache_scheme`), else the
activation dtype (bf16). Imports kvq.errors only (no torch: `kvq plan` stays light); the torch dtypes are
in `kvq.runtime.config`.
"""

from __future__ import annotations

from kvq.errors import KvqError

AUTO, BF16, FP8_E4M3, FP32 = "auto", "bf16", "fp8_e4m3", "fp32"
KV_CACHE_DTYPES = (AUTO, BF16, FP8_E4M3)
# bytes per cached value of each concrete KV dtype; fp32: the pages of the runtime's reference mode
KV_CACHE_DTYPE_BYTES = {BF16: 2, FP8_E4M3: 1, FP32: 4}
KV_CACHE_DTYPE_HELP = (
    "KV-cache dtype, as vLLM names them: auto (fp8_e4m3 when the checkpoint has calibrated kv scales, "
    "else the activation dtype, bf16), bf16 (or bfloat16) or fp8_e4m3 (or fp8)."
)
DTYPES = ("auto", "bfloat16", "float32")  # --dtype: the activations' (float32: the reference mode)
# every spelling either flag takes -> (its --kv-cache-dtype name, its --dtype name); None: not that flag's
_SPELLINGS = {
    "auto": (AUTO, "auto"),
    "bf16": (BF16, "bfloat16"),
    "bfloat16": (BF16, "bfloat16"),
    "torch.bfloat16": (BF16, "bfloat16"),
    "fp32": (None, "float32"),
    "float32": (None, "float32"),
    "float": (None, "float32"),
    "torch.float32": (None, "float32"),
    "fp8": (FP8_E4M3, None),
    "fp8_e4m3": (FP8_E4M3, None),
    "e4m3": (FP8_E4M3, None),
    "fp8e4m3": (FP8_E4M3, None),
    "fp8_e4m3fn": (FP8_E4M3, None),
    "float8_e4m3fn": (FP8_E4M3, None),
}


def check_kv_cache_dtype(value: str, flag: str = "--kv-cache-dtype") -> str:
    """The `KV_CACHE_DTYPES` name `value` spells, else a `KvqError` naming `flag` and the choices."""
    name = _SPELLINGS.get(value.lower(), (None, None))[0]
    if name is None:
        raise KvqError(f"{flag} {value!r}: use one of {', '.join(KV_CACHE_DTYPES)} (or bfloat16, fp8)")
    return name


def check_dtype(value: str, flag: str = "--dtype") -> str:
    """The `DTYPES` name `value` spells (`bf16` is `bfloat16`), else a `KvqError` naming `flag`."""
    name = _SPELLINGS.get(value.lower(), (None, None))[1]
    if name is None:
        raise KvqError(f"{flag} {value!r}: use one of {', '.join(DTYPES)} (or bf16, fp32)")
    return name


def kv_cache_dtype_flag(value: str) -> str:
    """`check_kv_cache_dtype` as a command-line callback: the error names `--kv-cache-dtype`."""
    return check_kv_cache_dtype(value)


def dtype_flag(value: str) -> str:
    """`check_dtype` as a command-line callback: the error names `--dtype`."""
    return check_dtype(value)


def resolve_kv_cache_dtype(value: str, has_kv_cache_scheme: bool, activation: str = BF16) -> str:
    """The concrete dtype `auto` stands for: fp8_e4m3 for a calibrated checkpoint, else `activation`."""
    value = check_kv_cache_dtype(value)
    if value != AUTO:
        return value
    return FP8_E4M3 if has_kv_cache_scheme else activation
