"""What `kvq check` found: per engine, whether it loads the checkpoint, and each rule a tensor breaks.

An `error` means the engine will refuse the checkpoint (or fail at load); a `warning` means it loads but
runs slower or less accurately than it could; a `note` says how the engine treats something (FP8 KV
scales it does not use, the MoE kernel it picks). Findings name the tensor or layer and the rule's source.
A checkpoint that declares MTP / NextN layers gets a second verdict per engine, kept apart: whether the
engine loads them to speculate (vLLM `--speculative-config '{"method": "mtp", ...}'`, SGLang
`--speculative-algorithm NEXTN`); an engine serves the main model without them.
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
    num_mtp_layers: int = 0  # config.json num_nextn_predict_layers (0: no MTP verdict)
    mtp_findings: list[Finding] = field(default_factory=list)

    @property
    def loads(self) -> bool:
        return not any(f.severity == ERROR for f in self.findings)

    @property
    def loads_mtp(self) -> bool | None:
        """Whether the engine loads the MTP layers to speculate; None when the checkpoint declares none."""
        if not self.num_mtp_layers:
            return None
        return self.loads and not any(f.severity == ERROR for f in self.mtp_findings)

    def add(self, rule: str, severity: str, where: str, message: str) -> None:
        self.findings.append(Finding(rule, severity, where, message))

    def add_mtp(self, rule: str, severity: str, where: str, message: str) -> None:
        self.mtp_findings.append(Finding(rule, severity, where, message))


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
            "engines": [{**asdict(v), "loads": v.loads, "loads_mtp": v.loads_mtp} for v in self.verdicts],
        }

    def lines(self, max_per_rule: int = 3) -> list[str]:
        """Human-readable summary: one line per engine, then its findings grouped by rule."""
        out = []
        for v in self.verdicts:
            errors = sum(f.severity == ERROR for f in v.findings)
            status = "loads" if v.loads else f"does NOT load ({errors} error(s))"
            out.append(f"{v.engine} (tp {v.tp}): {status}")
            out += _finding_lines(v.findings, max_per_rule)
            if v.loads_mtp is not None:
                mtp_errors = sum(f.severity == ERROR for f in v.mtp_findings)
                loads = "loads" if v.loads_mtp else f"does NOT load ({mtp_errors} error(s))"
                out.append(f"  MTP speculation ({v.num_mtp_layers} layer(s)): {loads}")
                out += _finding_lines(v.mtp_findings, max_per_rule)
        return out


def _finding_lines(findings: list[Finding], max_per_rule: int) -> list[str]:
    out = []
    by_rule: dict[tuple[str, str], list[Finding]] = {}
    for f in findings:
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
