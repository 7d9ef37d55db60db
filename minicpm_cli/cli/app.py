"""The `minicpm` command line: a Unix filter with one error boundary.

Audio (the payload) goes to stdout or a file, everything else to stderr. Our exceptions become one
line `minicpm: error: ...` with their exit status; usage mistakes caught by the parser exit 2;
`MINICPM_DEBUG=1` re-raises for a traceback. Heavy modules (torch, the pipeline) are imported inside
the commands so that `--help` stays fast.

The commands live in `cli.commands`, a module each: `say` and `reply` speak (through a running
server when one answers, else with the model here: `cli.speaker`), `bulk` speaks a file of items,
`serve` serves the speech API, `bench` measures, `voice` keeps saved voices, `backends` lists the
backends.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
from typing import Annotated

import typer

from .. import __version__
from .. import backends as registry
from ..errors import MinicpmError
from .commands import bench, bulk, say, serve, voice
from .signals import interrupt, terminate
from .streams import ReaderGone

# torch warns "No CUDA runtime is found, using CUDA_HOME=..." on stderr wherever a CUDA toolkit is
# installed but no GPU answers, e.g. any CPU run on a GPU machine's image: not ours to report
logging.getLogger("torch.utils.cpp_extension").addFilter(
    lambda record: not record.getMessage().startswith("No CUDA runtime is found"))

app = typer.Typer(
    name="minicpm",
    help="Text to speech on your own GPU with MiniCPM-o 2.6.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts contain [default: ...], which rich would eat as markup
)


def show_version(value: bool) -> None:
    if value:
        typer.echo(f"minicpm {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", callback=show_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """Text to speech on your own GPU with MiniCPM-o 2.6."""


def list_backends() -> None:
    """List the LLM-stage backends: what each is, what it costs, whether it is installed."""
    import shutil
    import textwrap

    width, indent = min(shutil.get_terminal_size((100, 24)).columns, 100), " " * 9
    for b in registry.REGISTRY.values():
        state = "" if b.available() else f"  [not installed: pip install 'minicpm-cli[{b.extra}]']"
        typer.echo(textwrap.fill(f"{b.name:8s} {b.summary}{state}", width, subsequent_indent=indent))
        typer.echo(textwrap.fill(b.cost, width, initial_indent=indent, subsequent_indent=indent))


app.command()(say.say)
app.command()(say.reply)
app.command()(bulk.bulk)
app.command()(serve.serve)
app.command()(bench.bench)
app.add_typer(voice.voice_app, name="voice")
app.command("backends")(list_backends)


# what a write can meet that the user can act on (a full or read-only disk, a quota, a file too large)
WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def main() -> None:
    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, interrupt)  # (typer turns the KeyboardInterrupt into exit status 130)
    try:
        app()
    except MinicpmError as e:
        if os.environ.get("MINICPM_DEBUG"):
            raise
        message = " ".join(str(e).split())  # always one line, whatever the exception text holds
        print(f"minicpm: error: {message}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except (MemoryError, RuntimeError) as e:  # (torch.OutOfMemoryError is a RuntimeError; torch not imported here)
        if os.environ.get("MINICPM_DEBUG") or not (isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"):
            raise
        print("minicpm: error: out of memory: use a smaller backend (--backend int4), fewer rows (--batch), or "
              "free memory held by other programs", file=sys.stderr)
        sys.exit(1)
    except OSError as e:  # (BrokenPipeError is one: the reader gone, below)
        if isinstance(e, BrokenPipeError):
            _reader_gone()
        if os.environ.get("MINICPM_DEBUG") or e.errno not in WRITE_ERRORS:
            raise
        print(f"minicpm: error: cannot write {e.filename or 'the output'}: {e.strerror}", file=sys.stderr)
        if e.filename is None and sys.stdout is not None:  # (a write to stdout, or to an open file: what is
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # left in its buffer goes nowhere)
        sys.exit(1)
    except ReaderGone:
        _reader_gone()
    finally:
        # The work is done or undone: an interrupt while the interpreter shuts down has nothing left
        # to stop, and Python's own handler would be back by then (killed by SIGINT, no message).
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _reader_gone() -> None:
    """The reader went away (e.g. `| head`): not an error. Point stdout at devnull so the
    interpreter's final flush does not complain."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(0)
