"""What `kvq check` found: per engine, whether it loads the checkpoint, and each rule a tensor breaks.

An `error` means the engine will refuse the checkpoint (or fail at load); a `warning` means it loads but
runs slower or less accurately than it could; a `note` says how the engine treats something (FP8 KV
scales it does not use, the MoE kernel it picks). Findings name the tensor or layer and the rule's source.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

ERROR, WARNING, NOTE = "error", "warning", "note"


@dataclass(frozen=True)
class Finding:
    rule: str  # e.g. "vllm.fused-scheme-equal"
    severity: str
    where: str  # the tensor, layer or config field
    message: str


@dataclass
class EngineVerdict:
    engine: str
    tp: int
    findings: list[Finding] = field(default_factory=list)
    schemes: dict[str, str] = field(default_factory=dict)  # engine layer -> predicted scheme / method
    marlin_moe: dict[str, bool] = field(default_factory=dict)  # vLLM: MoE layer -> Marlin kernel at this tp

    @property
    def loads(self) -> bool:
        return not any(f.severity == ERROR for f in self.findings)

    def add(self, rule: str, severity: str, where: str, message: str) -> None:
        self.findings.append(Finding(rule, severity, where, message))


@dataclass
class CheckReport:
    path: str
    verdicts: list[EngineVerdict]

    def verdict(self, engine: str) -> EngineVerdict:
        return next(v for v in self.verdicts if v.engine == engine)

    def loads(self, engine: str) -> bool:
        return self.verdict(engine).loads

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "engines": [{**asdict(v), "loads": v.loads} for v in self.verdicts],
        }

    def lines(self, max_per_rule: int = 3) -> list[str]:
        """Human-readable summary: one line per engine, then its findings grouped by rule."""
        out = []
        for v in self.verdicts:
            errors = sum(f.severity == ERROR for f in v.findings)
            status = "loads" if v.loads else f"does NOT load ({errors} error(s))"
            out.append(f"{v.engine} (tp {v.tp}): {status}")
            by_rule: dict[tuple[str, str], list[Finding]] = {}
            for f in v.findings:
                by_rule.setdefault((f.severity, f.rule), []).append(f)
            for (severity, rule), found in sorted(by_rule.items(), key=_severity_order):
                for f in found[:max_per_rule]:
                    out.append(f"  {severity} [{rule}] {f.where}: {f.message}")
                if len(found) > max_per_rule:
                    out.append(f"  ... and {len(found) - max_per_rule} more [{rule}] (--json lists all)")
        return out


def _severity_order(item: tuple[tuple[str, str], list[Finding]]) -> tuple[int, str]:
    (severity, rule), _ = item
    return ((ERROR, WARNING, NOTE).index(severity), rule)
