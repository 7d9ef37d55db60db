"""The `minicpm` executable's entry point: Ctrl-C is handled from the first instruction on.

Python's own SIGINT handler raises KeyboardInterrupt wherever the program is, so an interrupt while
typer, torch or the model are still being imported would end in a traceback. The handler here raises
it once, after saying so on stderr in one line, and then ignores further presses, so that the cleanup
it starts (a sink removing its partial file) runs to its end; the CLI exits with status 130.

A command that loaded no model (`say` through a server, `--help`, a usage error) leaves with
`os._exit` once its streams are flushed: Python's own teardown, freeing every object of numpy,
libsndfile's bindings and typer one by one, takes longer than such a command's work (about 0.2 s of
a 1 s `say` on the 2-core CPU machine). With torch loaded the interpreter exits as usual, so that
torch's, CUDA's and the compilers' exit handlers run; but not after Ctrl-C or SIGTERM (their cleanup
has run as the exception unwound), where a thread may still be inside torch (a server stopped while
its model loads), which the interpreter's teardown would abort (SIGABRT).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from .dependencies import missing
from .signals import INTERRUPTED, TERMINATED, interrupt


def main() -> None:
    try:  # (the handler installed inside: a Ctrl-C right after it is installed is caught here too)
        signal.signal(signal.SIGINT, interrupt)
        from .. import trace

        trace.mark("start")
        from .app import main as run

        trace.mark("cli")
    except KeyboardInterrupt:
        _exit(INTERRUPTED)
    except ModuleNotFoundError as e:  # (typer or numpy gone: before the CLI's own error boundary)
        _exit(_broken(e))
    try:
        run()
        code = None
    except KeyboardInterrupt:  # (one before the CLI's own error boundary: while click builds its parser)
        code = INTERRUPTED
    except SystemExit as e:
        code = e.code
    except ModuleNotFoundError as e:  # (a command's import of a package gone since the install)
        code = _broken(e)
    if code in (None, 0):  # (succeeded: a precompile helper it started may finish after it)
        helpers = sys.modules.get("minicpm_cli.backends.kernels.precompile")
        if helpers is not None:
            helpers.release()
    if code not in (INTERRUPTED, TERMINATED) and ("torch" in sys.modules or threading.active_count() > 1):
        sys.exit(code)
    _exit(code)


def _broken(error: ModuleNotFoundError) -> str:
    """The one line for a package of ours gone from this Python (`dependencies.missing`); any other
    missing module, or MINICPM_DEBUG set, raises on."""
    message = missing(error)
    if message is None or os.environ.get("MINICPM_DEBUG"):
        raise error
    return f"minicpm: error: {message}"


def _exit(code) -> None:
    """Leave now with `sys.exit(code)`'s status, our streams flushed, without the interpreter's teardown."""
    if code is None or isinstance(code, int):
        status = code or 0
    else:
        print(code, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # (closed when we were started: `>&-`)
            continue
        try:
            stream.flush()
        except (OSError, ValueError):  # (a closed or broken stream: Python's own exit would fail there too)
            status = status or 120
    os._exit(status)
