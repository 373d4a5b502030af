"""What a layer-streamed run (`kvq calibrate`, `kvq compress --method gptq|gptaq`) says about its cost: a
progress bar over decoder layers with an ETA, and one line after the first layer estimating the whole run
(time per layer x layers). Imports the standard library, rich and kvq.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

Clock = Callable[[], float]


def format_duration(seconds: float) -> str:
    """3.2 -> '3.2 s', 125 -> '2 min 5 s', 7260 -> '2 h 1 min'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def estimate_line(per_layer_s: float, num_layers: int, num_left: int) -> str:
    """The one-line estimate of a run of `num_layers` decoder layers, `num_left` of them still to run."""
    line = (
        f"estimate: {format_duration(per_layer_s)} per decoder layer x {num_layers} layers = about "
        f"{format_duration(per_layer_s * num_layers)} in all"
    )
    return line + f" ({num_left} to go: about {format_duration(per_layer_s * num_left)})"


class _EtaColumn(ProgressColumn):
    """Time left on the layers' bar: the mean time of the layers run so far x the layers left, counting
    down between them (blank on other bars sharing the display)."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def render(self, task: Task) -> Text:
        if not task.fields.get("is_layers"):
            return Text("")
        per_layer, since = task.fields.get("per_layer_s"), task.fields.get("since")
        if per_layer is None or since is None or task.total is None:
            return Text("ETA --", style="progress.remaining")
        left = per_layer * (task.total - task.completed) - (self.clock() - since)
        return Text(f"ETA {format_duration(max(left, 0.0))}", style="progress.remaining")


class LayerProgress:
    """`start(num_layers)`, then `layer_done(i)` after each layer, `stop()` at the end. The bar is drawn
    only when `show_bar` (other bars may join its `progress`); the estimate line is printed after the
    first layer this run finishes (a resumed run starts past layer 0)."""

    def __init__(self, label: str, console: Console, show_bar: bool = True, clock: Clock = time.monotonic):
        self.label, self.console, self.show_bar, self.clock = label, console, show_bar, clock
        self.progress: Progress | None = None
        self.task = TaskID(0)
        self.num_layers = self.num_done = self.num_run = 0
        self.started = 0.0

    def start(self, num_layers: int) -> None:
        self.num_layers, self.num_done, self.num_run, self.started = num_layers, 0, 0, self.clock()
        if not self.show_bar:
            return
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            _EtaColumn(self.clock),
        )
        self.progress = Progress(*columns, console=self.console)
        self.task = self.progress.add_task(self.label, total=num_layers, is_layers=True)
        self.progress.start()

    def layer_done(self, layer_idx: int) -> None:
        """Layer `layer_idx` (0-based) finished; the run goes through the layers in order."""
        now = self.clock()
        self.num_run += 1
        self.num_done = layer_idx + 1
        per_layer = (now - self.started) / self.num_run
        if self.num_run == 1:
            line = estimate_line(per_layer, self.num_layers, self.num_layers - self.num_done)
            console = self.progress.console if self.progress is not None else self.console
            console.print(line, soft_wrap=True)  # one line, whatever the width: logs and scripts read it
        if self.progress is not None:
            self.progress.update(self.task, completed=self.num_done, per_layer_s=per_layer, since=now)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
