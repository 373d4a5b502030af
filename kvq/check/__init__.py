"""`kvq check`: will vLLM, SGLang, transformers or the kvq runtime load this checkpoint, and if not, which
rule which tensor breaks. Headers and config only, any checkpoint (kvq's or not).

`check_checkpoint(path, engines, tp) -> CheckReport` is the entry point `kvq compress` (after writing)
and `kvq push --require-engine` call: `report.loads("sglang")` says whether SGLang main loads it,
`report.verdict("vllm").findings` why not. Every engine first needs the checkpoint to be what its
config.json describes (`kvq.checkpoint.validate`: the `checkpoint.*` rules); then its own rules run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvq.check import kvq_rules, sglang_rules, transformers_rules, vllm_rules
from kvq.check.report import ERROR, CheckReport, EngineVerdict
from kvq.check.view import CheckpointView, open_view
from kvq.checkpoint.config_sizes import Mismatch
from kvq.checkpoint.reader import CONFIG_NAME
from kvq.checkpoint.validate import checkpoint_mismatches
from kvq.errors import KvqError

ENGINES = ("vllm", "sglang", "transformers", "kvq")
_RULES = {"vllm": vllm_rules, "sglang": sglang_rules, "transformers": transformers_rules, "kvq": kvq_rules}


def check_checkpoint(path: str | Path, engines: Sequence[str] = ENGINES, tp: int = 1) -> CheckReport:
    """Check `path` against each engine's loading rules at tensor-parallel size `tp`."""
    unknown = [e for e in engines if e not in _RULES]
    if unknown:
        raise KvqError(f"--engine {unknown[0]!r} is not known; use one of {', '.join(ENGINES)}")
    if tp < 1:
        raise KvqError(f"--tp {tp}: the tensor-parallel size must be at least 1")
    view = open_view(path)
    _, mismatches = checkpoint_mismatches(view.file_config, view.tensors, view.root / CONFIG_NAME)
    return CheckReport(str(view.root), [_verdict(e, view, tp, mismatches) for e in engines])


def _verdict(engine: str, view: CheckpointView, tp: int, mismatches: list[Mismatch]) -> EngineVerdict:
    """The engine's own rules on a checkpoint that is what its config.json says; else the shared
    `checkpoint.*` rules it breaks (every engine builds the model from config.json and loads each tensor
    by name and shape, so none loads it)."""
    if not mismatches:
        return _RULES[engine].check(view, tp)
    verdict = EngineVerdict(engine, tp)
    for m in mismatches:
        verdict.add(f"checkpoint.{m.rule}", ERROR, m.where, f"{m.message}; {m.fix}")
    return verdict
