"""The KV-cache dtype vocabulary of every command, vLLM's: `auto`, `bf16`, `fp8_e4m3` (one definition).

`auto` is FP8 e4m3 when the checkpoint carries calibrated scales (a `kv_cache_scheme`), else the
activation dtype (bf16). Old spellings (`fp8`, `bfloat16`, ...) are refused with the name to use.
Imports kvq.errors only (no torch: `kvq plan` stays light); the torch dtypes are in `kvq.runtime.config`.
"""

from __future__ import annotations

from kvq.errors import KvqError

AUTO, BF16, FP8_E4M3 = "auto", "bf16", "fp8_e4m3"
KV_CACHE_DTYPES = (AUTO, BF16, FP8_E4M3)
KV_CACHE_DTYPE_BYTES = {BF16: 2, FP8_E4M3: 1}  # bytes per cached value
KV_CACHE_DTYPE_HELP = (
    "KV-cache dtype, as vLLM names them: auto (fp8_e4m3 when the checkpoint has calibrated kv scales, "
    "else the activation dtype, bf16), bf16 or fp8_e4m3."
)
# Spellings other tools (or earlier kvq) used, and the name that replaced each.
_RENAMED = {
    "fp8": FP8_E4M3,
    "e4m3": FP8_E4M3,
    "fp8e4m3": FP8_E4M3,
    "fp8_e4m3fn": FP8_E4M3,
    "float8_e4m3fn": FP8_E4M3,
    "bfloat16": BF16,
    "torch.bfloat16": BF16,
}


def check_kv_cache_dtype(value: str, flag: str = "--kv-cache-dtype") -> str:
    """`value` if it is one of `KV_CACHE_DTYPES`, else a `KvqError` naming `flag` and the right name."""
    if value in KV_CACHE_DTYPES:
        return value
    renamed = _RENAMED.get(value.lower())
    if renamed is not None:
        raise KvqError(f"{flag} {value!r}: the name is now {renamed!r} (vLLM's); pass {flag} {renamed}")
    raise KvqError(f"{flag} {value!r}: use one of {', '.join(KV_CACHE_DTYPES)}")


def kv_cache_dtype_flag(value: str) -> str:
    """`check_kv_cache_dtype` as a command-line callback: the error names `--kv-cache-dtype`."""
    return check_kv_cache_dtype(value)


def resolve_kv_cache_dtype(value: str, has_kv_cache_scheme: bool, activation: str = BF16) -> str:
    """The concrete dtype `auto` stands for: fp8_e4m3 for a calibrated checkpoint, else `activation`."""
    value = check_kv_cache_dtype(value)
    if value != AUTO:
        return value
    return FP8_E4M3 if has_kv_cache_scheme else activation
