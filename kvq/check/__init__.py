"""`kvq check`: will vLLM, SGLang, transformers or the kvq runtime load this checkpoint, and if not, which
rule which tensor breaks. Headers and config only, any checkpoint (kvq's or not).

`check_checkpoint(path, engines, tp) -> CheckReport` is the entry point `kvq compress` (after writing)
and `kvq push --require-engine` call: `report.loads("sglang")` says whether SGLang main loads it,
`report.verdict("vllm").findings` why not.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvq.check import kvq_rules, sglang_rules, transformers_rules, vllm_rules
from kvq.check.report import CheckReport
from kvq.check.view import open_view
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
    return CheckReport(str(view.root), [_RULES[e].check(view, tp) for e in engines])
