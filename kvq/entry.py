"""The `kvq` console script: starts `kvq compress`'s worker server first, then runs the command line.

Ctrl-C at any point (start-up imports included) ends with one line on stderr and exit code 130.
"""

from __future__ import annotations

import sys

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what shells report


def main() -> None:
    try:
        if sys.argv[1:2] == ["compress"] and not {"--help", "-h"} & set(sys.argv):
            from kvq.compress.forkserver import start_early

            start_early()  # the server loads the shard job while the command line below loads itself
        from kvq.cli import main as cli_main

        cli_main()
        return
    except KeyboardInterrupt:
        pass
    # outside the handler: an exit raised in it carries the KeyboardInterrupt along, and `python -m`
    # then reports the process as killed by SIGINT
    print("kvq: interrupted", file=sys.stderr)
    sys.exit(INTERRUPTED_EXIT_CODE)
