"""A command's standard streams: text in (an argument, a file, stdin whole or line by line as it
arrives) and audio out (chunks written to a sink as they come, a progress bar on a terminal's
stderr, the reader of stdout going away). No torch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from ..errors import OptionError, UsageError


class ReaderGone(Exception):
    """The reader of our stdout closed the pipe (not an OSError, so click leaves it to `app.main`)."""


def read_text(text: Optional[str], file: Optional[str]) -> str:
    """The whole text: the argument, -f FILE, or stdin read to its end."""
    if text is not None and file is not None:
        raise OptionError("give the text as an argument or with -f, not both")
    if text is not None:
        return text
    if file is not None and file != "-":
        try:
            return Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read {file}: {e}") from None
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no text: give it as an argument, with -f FILE, or on standard input")
    return sys.stdin.read()


def input_lines(file: Optional[str]):
    """Input lines as they arrive (stdin is read line by line, not to the end first)."""
    if file is not None and file != "-":
        try:
            with open(file, encoding="utf-8") as f:
                yield from f
        except OSError as e:
            raise UsageError(f"cannot read {file}: {e}") from None
        return
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("--lines reads standard input or -f FILE")
    yield from iter(sys.stdin.readline, "")


def play(chunks, sink, on_chunk=None) -> None:
    """Write every chunk to the sink as it comes; on any failure or interrupt the sink is discarded."""
    try:
        for chunk in chunks:
            if len(chunk.samples):
                sink.write(chunk.samples)
            if on_chunk:
                on_chunk(chunk)
        sink.close()
    except BrokenPipeError:
        sink.abort()
        raise ReaderGone() from None
    except BaseException:
        sink.abort()
        raise


def progress():
    """A tqdm bar of audio seconds on stderr when it is a terminal, else None."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(desc="speaking", unit=" s audio", file=sys.stderr, leave=False,
                bar_format="{desc}: {n:.1f}{unit} [{elapsed}, {rate_fmt}]")
