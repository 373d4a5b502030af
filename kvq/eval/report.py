"""A `kvq eval` report as text: the "metric | baseline | model | delta | 95% CI" rows of each run, as rich
tables for the terminal and as Markdown for a model card (`kvq push`). Reads the report dict that
`kvq eval --json` writes; imports rich only.
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

COLUMNS = ("metric", "baseline", "model", "delta", "95% CI")


def _value(unit: str, value: float | None, signed: bool = False) -> str:
    """A metric's value (a fraction in percent), or with `signed` a change (a fraction in points)."""
    if value is None:
        return ""
    sign = "+" if signed else ""
    if unit == "fraction":
        return f"{100 * value:{sign}.1f}" + (" pt" if signed else "%")
    return f"{value:{sign}.4f}"


def _interval(unit: str, interval: list[float] | None) -> str:
    if not interval:
        return ""
    low, high = interval
    if unit == "fraction":
        return f"[{100 * low:+.1f}, {100 * high:+.1f}] pt"
    return f"[{low:+.4f}, {high:+.4f}]"


def metric_rows(run: dict) -> list[tuple[str, ...]]:
    """One row per metric: the CI is the paired interval of the delta where there is a baseline, else the
    model's own interval."""
    rows: list[tuple[str, ...]] = []
    for m in run["metrics"]:
        unit, has_delta = m["unit"], m.get("delta") is not None
        if has_delta or not m.get("model_ci95"):
            interval = _interval(unit, m.get("ci95"))
        elif unit == "fraction":  # the model's own value: shown as a range, not a signed change
            interval = "[{:.1f}, {:.1f}]%".format(*(100 * v for v in m["model_ci95"]))
        else:
            interval = "[{:.4f}, {:.4f}]".format(*m["model_ci95"])
        rows.append(
            (
                m["name"],
                _value(unit, m.get("baseline")),
                _value(unit, m["model"]),
                _value(unit, m.get("delta"), signed=True),
                interval,
            )
        )
    return rows


def engine_line(report: dict) -> str:
    """Which engine computed the numbers: the kvq runtime, or each server's name and version."""
    engine = report.get("engine") or {"name": "kvq runtime", "version": report.get("kvq_version")}
    if "servers" not in engine:
        return f"{engine['name']} {engine.get('version') or ''}".strip()
    return "; ".join(
        f"{side}: {s['name']} {s.get('version') or '(version not reported)'}"
        for side, s in engine["servers"].items()
    )


def run_title(report: dict, run: dict) -> str:
    checkpoint = report[run["checkpoint"]]
    title = f"{Path(checkpoint['path']).name} ({_settings(checkpoint)}, KV {run['kv_cache']})"
    baseline = report.get("baseline")
    if baseline is not None:
        title += f" vs {Path(baseline['path']).name} ({_settings(baseline)}, KV {baseline['kv_cache']})"
    return title


def _settings(checkpoint: dict) -> str:
    """The format, and the opt-in runtime settings that change the numerics where they are set."""
    parts = [checkpoint.get("format", "served")]
    if checkpoint.get("int4_compute", "w4a16") != "w4a16":
        parts.append(f"INT4 as {checkpoint['int4_compute']}")
    if checkpoint.get("lm_head_weights", "stored") != "stored":
        parts.append(f"{checkpoint['lm_head_weights']} lm_head")
    return ", ".join(parts)


def rich_tables(report: dict) -> list[Table]:
    tables = []
    for run in report["runs"]:
        table = Table(
            title=f"kvq eval: {run_title(report, run)}", caption=f"computed by {engine_line(report)}"
        )
        for column in COLUMNS:
            is_metric = column == "metric"
            table.add_column(column, justify="left" if is_metric else "right", no_wrap=is_metric)
        for row in metric_rows(run):
            table.add_row(*row)
        tables.append(table)
    return tables


def markdown_tables(report: dict) -> str:
    """Every run's table in Markdown, each under a line naming the run."""
    parts = []
    for run in report["runs"]:
        lines = [
            f"**{run_title(report, run)}**",
            "",
            "| " + " | ".join(COLUMNS) + " |",
            "|---|" + "---:|" * (len(COLUMNS) - 1),
        ]
        lines += [
            "| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in metric_rows(run)
        ]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)
