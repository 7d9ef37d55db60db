"""The handlers of the signals that end a command: Ctrl-C (SIGINT) and `kill` (SIGTERM).

Shared by the entry point, which installs the SIGINT handler at its first instruction, and the
command line's error boundary, which installs both again for a caller that runs it directly.
"""

from __future__ import annotations

import signal
import sys

# A Ctrl-C leaves by os._exit: CPython 3.11 marks a KeyboardInterrupt raised inside exec'd source
# (dataclasses and typing build methods that way while modules import) as unhandled even once caught,
# and an interpreter that exits normally then kills itself with SIGINT (status -2, not 130).
INTERRUPTED = 130


def interrupt(signum, frame):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stderr.write("minicpm: interrupted\n")
    raise KeyboardInterrupt


def terminate(signum, frame):
    # SystemExit unwinds like an exception, so sinks discard their partial files on `kill`.
    raise SystemExit(128 + signum)
