"""The `kvq` console script: starts `kvq compress`'s worker server first, then runs the command line.

Ctrl-C at any point (start-up imports included) ends with one line on stderr and exit code 130, also where
a library's import machinery turned the KeyboardInterrupt into another error (numpy or transformers'
lazy imports interrupted half way raise RecursionError / ModuleNotFoundError): the SIGINT is remembered.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what shells report


def main() -> None:
    interrupted: list[int] = []

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        interrupted.append(signum)
        raise KeyboardInterrupt  # what Python's own handler does

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored
        signal.signal(signal.SIGINT, on_sigint)
    try:
        if sys.argv[1:2] == ["compress"] and not {"--help", "-h"} & set(sys.argv):
            from kvq.compress.forkserver import start_early

            start_early()  # the server loads the shard job while the command line below loads itself
        from kvq.cli import main as cli_main

        cli_main()
        return
    except KeyboardInterrupt:
        pass
    except SystemExit:
        raise
    except BaseException:
        if not interrupted:
            raise
    # outside the handler: an exit raised in it carries the KeyboardInterrupt along, and `python -m`
    # then reports the process as killed by SIGINT
    print("kvq: interrupted", file=sys.stderr)
    sys.exit(INTERRUPTED_EXIT_CODE)
