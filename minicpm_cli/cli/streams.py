"""A command's standard streams: text in (an argument, a file, stdin whole or line by line as it
arrives) and audio out (chunks written to a sink as they come, a progress bar on a terminal's
stderr, the reader of stdout going away). No torch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

from ..errors import OptionError, UsageError, unicode_text


BOM = "\ufeff"  # a byte order mark, as Windows' Notepad begins a UTF-8 file: not text to speak


class ReaderGone(Exception):
    """The reader of our stdout closed the pipe (not an OSError, so click leaves it to `app.main`)."""


def read_text(text: Optional[str], file: Optional[str]) -> str:
    """The whole text: the argument, -f FILE, or stdin read to its end."""
    if text is not None and file is not None:
        raise OptionError("give the text as an argument or with -f, not both")
    if text is not None:
        return unicode_text(text, "the text")
    if file is not None and file != "-":
        try:
            return Path(file).read_text(encoding="utf-8-sig")  # (a byte order mark is not text)
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read {file}: {e}") from None
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no text: give it as an argument, with -f FILE, or on standard input")
    return unicode_text(sys.stdin.read().removeprefix(BOM), "standard input")


ARRIVAL_QUIET = 0.005  # s: after a read, more input within this long belongs to the same arrival


def arriving(file: Optional[str]):
    """Standard input (no -f, or -f -) as it arrives -> (text, ended): each item all that was there
    to read (what more came within ARRIVAL_QUIET included), and whether the input ended right after
    it. `echo TEXT | minicpm say` therefore gives its text whole in one item; a slow writer's text
    comes as it is written."""
    if file is not None and file != "-":
        raise ValueError("arriving() reads standard input")
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no text: give it as an argument, with -f FILE, or on standard input")
    return _arrivals(sys.stdin.fileno())


def _arrivals(fd: int):
    import codecs
    import select

    utf8 = codecs.getincrementaldecoder("utf-8-sig")()  # (a byte order mark first is not text)

    def text(data: bytes, final: bool) -> str:
        try:
            return utf8.decode(data, final)
        except UnicodeDecodeError as e:
            raise UsageError(f"standard input is not UTF-8 text: {e}") from None

    while True:
        data = os.read(fd, 1 << 16)  # (waits for the writer)
        if not data:
            yield text(b"", True), True
            return
        while select.select([fd], [], [], ARRIVAL_QUIET)[0]:
            more = os.read(fd, 1 << 16)
            if not more:
                yield text(data, True), True
                return
            data += more
        yield text(data, False), False


def input_lines(file: Optional[str]):
    """Input lines as they arrive (stdin is read line by line, not to the end first). The file is
    opened here, not at the first line: one that cannot be read, or no input to read, is said before
    the model loads."""
    if file is not None and file != "-":
        try:
            f = open(file, "rb")
        except OSError as e:
            raise UsageError(f"cannot read {file}: {e}") from None
        return _file_lines(f, file)
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("--lines reads standard input or -f FILE")
    return (unicode_text(line.removeprefix(BOM) if n == 1 else line, f"standard input's line {n}")
            for n, line in enumerate(iter(sys.stdin.readline, ""), 1))


def _file_lines(f, file: str):
    try:
        with f:  # (each line decoded alone: an error names its line)
            for n, line in enumerate(f, 1):
                try:
                    yield line.decode("utf-8-sig" if n == 1 else "utf-8").replace("\r\n", "\n")
                except UnicodeDecodeError:
                    raise UsageError(f"{file} is not UTF-8 text (line {n})") from None
    except OSError as e:
        raise UsageError(f"cannot read {file}: {e}") from None


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
