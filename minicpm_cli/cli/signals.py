"""The handlers of the signals that end a command: Ctrl-C (SIGINT) and `kill` (SIGTERM).

Shared by the entry point, which installs the SIGINT handler at its first instruction, and the
command line's error boundary, which installs both again for a caller that runs it directly.
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading

# A Ctrl-C leaves by os._exit: CPython 3.11 marks a KeyboardInterrupt raised inside exec'd source
# (dataclasses and typing build methods that way while modules import) as unhandled even once caught,
# and an interpreter that exits normally then kills itself with SIGINT (status -2, not 130).
INTERRUPTED = 130


def interrupt(signum, frame):
    """The first Ctrl-C: one line on stderr, a KeyboardInterrupt; later presses are ignored (`_again`)."""
    signal.signal(signal.SIGINT, _again)
    sys.unraisablehook = _unraisable
    sys.stderr.write("minicpm: interrupted\n")
    raise KeyboardInterrupt


# The KeyboardInterrupt can land where CPython may only report an exception and then drops it: a
# weakref callback (importlib's module locks have one), a __del__, the garbage collector. Its report
# would be a traceback and the command would run on. `_unraisable` takes such a report instead and
# asks for the interrupt again from another thread, so that it is raised once the main thread is back
# in ordinary code; later presses stay ignored.
_state = {"swallowed": False, "in_hook": False}


def _again(signum, frame):
    if not _state["swallowed"]:
        return  # (a later press: the cleanup that the first one started runs to its end)
    if _state["in_hook"]:
        _ask_again()  # (raised inside the hook it would be dropped again)
        return
    _state["swallowed"] = False
    raise KeyboardInterrupt


def _ask_again() -> None:
    # (a little later: starting a thread waits for it, and a signal asked for at once would be
    # handled in that wait, still inside the hook)
    timer = threading.Timer(0.01, _thread.interrupt_main)
    timer.daemon = True
    timer.start()


def _unraisable(unraisable) -> None:
    if unraisable.exc_type is None or not issubclass(unraisable.exc_type, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)
        return
    _state["in_hook"] = True
    try:
        _state["swallowed"] = True
        _ask_again()
    finally:
        _state["in_hook"] = False


def terminate(signum, frame):
    # SystemExit unwinds like an exception, so sinks discard their partial files on `kill`.
    raise SystemExit(128 + signum)
