"""The `kvq` command line: registers each subcommand and turns user errors into one line and exit code 2."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import typer

from kvq import __version__
from kvq.errors import KvqError

# name -> (module, function); a command's module is imported only when that command runs (or for the
# full `kvq --help`), so `kvq compress` and `kvq plan` start without torch.
COMMANDS = {
    "inspect": ("kvq.commands.inspect_cmd", "inspect_command"),
    "default-model": ("kvq.commands.default_model", "default_model_command"),
    "plan": ("kvq.commands.plan_cmd", "plan_command"),
    "compress": ("kvq.commands.compress_cmd", "compress_command"),
    "check": ("kvq.commands.check_cmd", "check_command"),
    "generate": ("kvq.commands.generate_cmd", "generate_command"),
    "calibrate": ("kvq.commands.calibrate_cmd", "calibrate_command"),
    "serve": ("kvq.commands.serve_cmd", "serve_command"),
    "eval": ("kvq.commands.eval_cmd", "eval_command"),
    "push": ("kvq.commands.push_cmd", "push_command"),
}
BENCH_COMMANDS = {
    "compress": ("kvq.bench.compress", "bench_compress_command"),
    "decode": ("kvq.bench.decode_cmd", "bench_decode_command"),
    "integrity": ("kvq.bench.integrity", "bench_integrity_command"),
    "calibrate": ("kvq.bench.calibrate", "bench_calibrate_command"),
    "handoff": ("kvq.bench.handoff", "bench_handoff_command"),
    "serve": ("kvq.bench.serve", "bench_serve_command"),
    "gptq": ("kvq.bench.gptq_quality", "bench_gptq_command"),
    "tp": ("kvq.bench.tensor_parallel", "bench_tp_command"),
}


def build_app(command: str | None = None) -> typer.Typer:
    """The `kvq` app with every subcommand registered, or only `command` when it names one."""
    app = typer.Typer(
        name="kvq",
        help="Compress LLM checkpoints to INT4, calibrate FP8 KV-cache scales, and serve them from a checked "
        "paged KV pool.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
    )
    app.callback()(_root)
    wanted = [command] if command in COMMANDS else list(COMMANDS)
    for name in wanted:
        app.command(name)(_load(*COMMANDS[name]))
    if command not in COMMANDS:
        bench_app = typer.Typer(help="Benchmarks whose numbers go into BENCHMARKS.md.", no_args_is_help=True)
        for name, target in BENCH_COMMANDS.items():
            bench_app.command(name)(_load(*target))
        app.add_typer(bench_app, name="bench")
    return app


def _load(module: str, function: str) -> Callable[..., object]:
    return getattr(importlib.import_module(module), function)


def _version_callback(value: bool) -> None:
    if value:
        print(f"kvq {__version__}")
        raise typer.Exit()


def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version."
    ),
) -> None:
    """kvq: compressed LLM inference toolkit."""


def main() -> None:
    """Console-script entry point: a `KvqError` becomes `kvq: error: ...` on stderr and exit code 2; Ctrl-C
    that no command handled itself, `kvq: interrupted` and 130 (typer's own exit for it says nothing)."""
    try:
        build_app(sys.argv[1] if len(sys.argv) > 1 else None)()
    except KvqError as e:
        print(f"kvq: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except SystemExit as e:
        if isinstance(getattr(e.__context__, "__cause__", None), KeyboardInterrupt):
            raise KeyboardInterrupt from None  # kvq.entry prints the line
        raise
