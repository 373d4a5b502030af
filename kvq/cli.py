"""The `kvq` command line: registers each subcommand and turns user errors into one line and exit code 2."""

from __future__ import annotations

import sys

import typer

from kvq import __version__
from kvq.bench.calibrate import bench_calibrate_command
from kvq.bench.compress import bench_compress_command
from kvq.bench.decode import bench_decode_command
from kvq.bench.integrity import bench_integrity_command
from kvq.commands.calibrate_cmd import calibrate_command
from kvq.commands.compress_cmd import compress_command
from kvq.commands.default_model import default_model_command
from kvq.commands.generate_cmd import generate_command
from kvq.commands.inspect_cmd import inspect_command
from kvq.commands.plan_cmd import plan_command
from kvq.errors import KvqError

app = typer.Typer(
    name="kvq",
    help="Compress LLM checkpoints to INT4, calibrate FP8 KV-cache scales, and serve them from a checked "
    "paged KV pool.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks whose numbers go into BENCHMARKS.md.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

app.command("inspect")(inspect_command)
app.command("default-model")(default_model_command)
app.command("plan")(plan_command)
app.command("compress")(compress_command)
bench_app.command("compress")(bench_compress_command)
bench_app.command("decode")(bench_decode_command)
bench_app.command("integrity")(bench_integrity_command)
app.command("generate")(generate_command)
app.command("calibrate")(calibrate_command)
bench_app.command("calibrate")(bench_calibrate_command)


def _version_callback(value: bool) -> None:
    if value:
        print(f"kvq {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version."
    ),
) -> None:
    """kvq: compressed LLM inference toolkit."""


def main() -> None:
    """Console-script entry point: a `KvqError` becomes `kvq: error: ...` on stderr and exit code 2."""
    try:
        app()
    except KvqError as e:
        print(f"kvq: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
