"""The settings of one `kvq compress --method gptq` run besides the recipe's: the single source of the
defaults its CLI options show. Imports the standard library and kvq (calibrate config, errors).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvq.calibrate.calibration_config import CalibrationConfig
from kvq.errors import KvqError

GPTAQ_ALPHA = 0.25  # --method gptaq's default correction scale: the GPTAQ reference implementation's


@dataclass(frozen=True)
class GptqConfig:
    """Calibration text (as `kvq calibrate`), the MoE options and whether KV scales are measured too.

    An expert routed fewer than `moe_min_tokens` calibration tokens keeps round-to-nearest: a Hessian
    from a handful of tokens fits those tokens, not the expert's inputs. `moe_calibrate_all_experts`
    feeds every token to every expert's Hessians (the output still follows the real routing).
    """

    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    moe_min_tokens: int = 128
    moe_calibrate_all_experts: bool = False
    calibrate_kv: bool = False
    gptaq_alpha: float | None = None  # --method gptaq: the asymmetric correction's scale; None: GPTQ
    true_sequential: bool = False  # a layer's Linears group by group (`layer.quantize_layer`)

    def __post_init__(self) -> None:
        if self.moe_min_tokens < 0:
            raise KvqError(f"--moe-min-tokens must be 0 or more, got {self.moe_min_tokens}")
        if self.gptaq_alpha is not None and not 0 <= self.gptaq_alpha <= 1:
            raise KvqError(f"--gptaq-alpha must be in [0, 1], got {self.gptaq_alpha}")

    def record(self) -> dict:
        """What of this config decides the output bytes (recorded in the job identity)."""
        c = self.calibration
        record: dict[str, object] = {
            "moe_min_tokens": self.moe_min_tokens,
            "moe_calibrate_all_experts": self.moe_calibrate_all_experts,
            "calibrate_kv": c.strategy if self.calibrate_kv else None,
            "dtype": c.dtype,
        }
        if self.gptaq_alpha is not None:  # only then: GPTQ jobs of earlier versions still resume
            record["gptaq_alpha"] = self.gptaq_alpha
        if self.true_sequential:
            record["true_sequential"] = True
        return record
