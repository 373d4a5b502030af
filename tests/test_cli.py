"""The command line: `kvq --help` lists every command; `kvq compress` and `kvq plan` start without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvq.cli import BENCH_COMMANDS, COMMANDS, build_app


def test_help_lists_every_command() -> None:
    result = CliRunner().invoke(build_app(), ["--help"])
    assert result.exit_code == 0
    assert all(name in result.output for name in [*COMMANDS, "bench"])
    bench = CliRunner().invoke(build_app(), ["bench", "--help"])
    assert all(name in bench.output for name in BENCH_COMMANDS)


@pytest.mark.parametrize("command", ["compress", "plan"])
def test_header_only_commands_do_not_import_torch(command: str) -> None:
    """Their parent process reads headers and plans; torch would add ~1 s to every run."""
    code = (
        "import sys; from kvq.cli import build_app; "
        f"app = build_app({command!r}); import kvq.compress.runner; print('torch' in sys.modules)"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "False"
