"""The `minicpm` executable's entry point: Ctrl-C is handled from the first instruction on.

Python's own SIGINT handler raises KeyboardInterrupt wherever the program is, so an interrupt while
typer, torch or the model are still being imported would end in a traceback. The handler here raises
it once, after saying so on stderr in one line, and then ignores further presses, so that the cleanup
it starts (a sink removing its partial file) runs to its end; the CLI exits with status 130.
"""

from __future__ import annotations

import signal
import sys


def interrupt(signum, frame):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stderr.write("minicpm: interrupted\n")
    raise KeyboardInterrupt


def main() -> None:
    signal.signal(signal.SIGINT, interrupt)
    try:
        from . import trace

        trace.mark("start")
        from .cli import main as run

        trace.mark("cli")
    except KeyboardInterrupt:
        sys.exit(130)
    run()
