"""The PNG of `kvq bench serve`: output tok/s, p50 TTFT and p50 TPOT against concurrency, one line per
server. Imports matplotlib (a dev/bench dependency, loaded only to plot) and kvq.bench.serve_load.
"""

from __future__ import annotations

from pathlib import Path

from kvq.bench.serve_load import LevelResult
from kvq.errors import KvqError


def plot_levels(results: dict[str, list[LevelResult]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise KvqError(f"--plot needs matplotlib ({e}); install it: pip install matplotlib") from e
    panels = [
        ("output tok/s", lambda r: r.output_tok_s),
        ("TTFT p50 (s)", lambda r: r.ttft_s["p50"]),
        ("TPOT p50 (ms)", lambda r: 1e3 * r.tpot_s["p50"]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (title, value) in zip(axes, panels, strict=True):
        for label, levels in results.items():
            ax.plot([r.concurrency for r in levels], [value(r) for r in levels], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
