"""The handlers of the signals that end a command: Ctrl-C (SIGINT) and `kill` (SIGTERM).

Shared by the entry point, which installs the SIGINT handler at its first instruction, and the
command line's error boundary, which installs both again for a caller that runs it directly. The
first interrupt also installs a `sys.unraisablehook` that raises it again where CPython dropped it
(below).
"""

from __future__ import annotations

import signal
import sys
import threading

# A Ctrl-C leaves by os._exit: CPython 3.11 marks a KeyboardInterrupt raised inside exec'd source
# (dataclasses and typing build methods that way while modules import) as unhandled even once caught,
# and an interpreter that exits normally then kills itself with SIGINT (status -2, not 130).
INTERRUPTED = 130
TERMINATED = 128 + signal.SIGTERM  # (`terminate`'s status)


def interrupt(signum, frame):
    """The first Ctrl-C: one line on stderr, a KeyboardInterrupt; later presses are ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.unraisablehook is not _unraisable:
        _previous[0] = sys.unraisablehook
        sys.unraisablehook = _unraisable
    sys.stderr.write("minicpm: interrupted\n")
    raise KeyboardInterrupt


# The KeyboardInterrupt can land where CPython may only report an exception and then drops it: a
# weakref callback (importlib's module locks have one), a __del__, the garbage collector. Its report
# would be a traceback and the command would run on. `_unraisable` takes such a report instead and
# sends SIGINT again to the main thread a little later (a real signal, so that a blocking call such
# as a read of stdin is interrupted too), handled once by `_again`, so that the interrupt is raised
# in ordinary code; presses after it stay ignored. Other reports go to the hook that was there.
_previous = [sys.__unraisablehook__]
_in_hook = [False]


def _again(signum, frame):
    if _in_hook[0]:
        _ask_again()  # (raised inside the hook it would be dropped again)
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _ask_again() -> None:
    # (10 ms later: starting a thread waits for it, and a signal handled in that wait would still
    # be inside the hook)
    timer = threading.Timer(0.01, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.daemon = True
    timer.start()


def _unraisable(unraisable) -> None:
    ours = unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt)
    if not ours or threading.current_thread() is not threading.main_thread():
        _previous[0](unraisable)  # (signal handlers can only be set on the main thread)
        return
    _in_hook[0] = True
    try:
        signal.signal(signal.SIGINT, _again)
        _ask_again()
    finally:
        _in_hook[0] = False


def terminate(signum, frame):
    # SystemExit unwinds like an exception, so sinks discard their partial files on `kill`.
    raise SystemExit(128 + signum)
