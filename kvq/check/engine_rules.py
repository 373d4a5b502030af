"""What `kvq check` asks of vLLM and SGLang alike, in order: the model's TP split, a quantization format kvq
checks, the engine's layer rules, then its MTP loader's. Each engine's module adds its own rules after."""

from __future__ import annotations

from collections.abc import Callable

from kvq.check.ct_layers import is_checked_format
from kvq.check.mtp_rules import MtpLoader, check_mtp
from kvq.check.report import EngineVerdict
from kvq.check.tp_rules import check_engine_tp
from kvq.check.view import CheckpointView

LayerRules = Callable[[CheckpointView, EngineVerdict, int], None]


def check_engine(
    view: CheckpointView, verdict: EngineVerdict, check_layers: LayerRules, mtp: MtpLoader
) -> bool:
    """Run the shared rules into `verdict` (at its tp); False when the format is not one kvq checks (then
    nothing more is)."""
    check_engine_tp(view, verdict, verdict.tp)
    if not is_checked_format(view, verdict):
        return False
    check_layers(view, verdict, verdict.tp)
    check_mtp(view, verdict, verdict.tp, mtp)
    return True
