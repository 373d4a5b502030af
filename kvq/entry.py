"""The `kvq` console script: starts `kvq compress`'s worker server first, then runs the command line."""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:2] == ["compress"] and not {"--help", "-h"} & set(sys.argv):
        from kvq.compress.forkserver import start_early

        start_early()  # the server loads the shard job while the command line below loads itself
    from kvq.cli import main as cli_main

    cli_main()
