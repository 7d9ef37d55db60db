"""Captions: the text of a stream of audio chunks as timed cues, and cues as SRT or WebVTT text.

Contract: in, the chunks a speaker yields (anything with `samples`, `marks` and `final`, as
`pipeline.AudioChunk`: each mark is (sample, text), the sample counted from its utterance's start
where the audio of the first frame generated after the TTS was given that text begins); out, `Cue`s
in samples of the audio written. A cue starts at its mark and ends where the next cue starts; the
last ends at the audio's last sample. So cues are monotonic, never overlap, and tile the audio from
the first mark to the end; times are sample counts, never an estimate (docs/streaming.md,
"Captions", says what they mean for the words). Utterances that follow each other in one stream (an
AudioChunk with `final` ends one) are laid end to end. Knows nothing of models or torch; the CLI,
`bulk` and the server all time cues here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import OptionError
from . import files
from .files import write_whole

FORMATS = ("srt", "vtt")


@dataclass(frozen=True)
class Cue:
    start: int  # first sample
    end: int  # one past the last sample
    text: str  # whitespace collapsed

    def timestamp(self, sample_rate: int) -> dict:
        """The cue as the server sends it (`timestamps`, `*.caption` events): seconds and samples."""
        return {"text": self.text, "start": round(self.start / sample_rate, 6), "end": round(self.end / sample_rate, 6),
                "start_sample": self.start, "end_sample": self.end}


class Timeline:
    """Cues as chunks arrive: `add(chunk)` returns the cues it completed (a cue completes when the next
    one starts), `finish()` the last one, ending at the audio's length; `cues` holds every cue
    completed so far. A server's chunks carry no marks but, where asked, the cues the server timed
    here (`cues`: `Cue.timestamp`'s dicts, counted from the utterance's start), taken as they are."""

    def __init__(self) -> None:
        self.cues: list[Cue] = []
        self.length = 0  # samples written so far
        self._offset = 0  # where the current utterance starts
        self._pending: tuple[int, str] | None = None  # (start, text) of the cue not yet ended

    def add(self, chunk) -> list[Cue]:
        done = []
        for sample, text in getattr(chunk, "marks", ()):
            done += self._mark(self._offset + sample, text)
        for cue in getattr(chunk, "cues", ()):
            done.append(Cue(self._offset + cue["start_sample"], self._offset + cue["end_sample"], cue["text"]))
        self.length += len(chunk.samples)
        if getattr(chunk, "final", False):
            self._offset = self.length
        self.cues += done
        return done

    def _mark(self, at: int, text: str) -> list[Cue]:
        if self._pending is None:
            self._pending = (at, text)
            return []
        start, held = self._pending
        if at < start:
            raise ValueError(f"marks out of order: {at} after {start}")
        if at == start or not text.strip():  # (nothing to show apart, or no audio of its own)
            self._pending = (start, held + text)
            return []
        self._pending = (at, text)
        return [Cue(start, at, " ".join(held.split()))] if held.strip() else []

    def finish(self) -> list[Cue]:
        """The last cue, ending at the audio written (an empty list when nothing was said)."""
        if self._pending is None or not self._pending[1].strip():
            return []
        start, text = self._pending
        self._pending = None
        last = [Cue(min(start, self.length), self.length, " ".join(text.split()))]
        self.cues += last
        return last


def cues(chunks: Iterable) -> list[Cue]:
    """Every cue of `chunks`, in order."""
    timeline = Timeline()
    for chunk in chunks:
        timeline.add(chunk)
    timeline.finish()
    return timeline.cues


def timed(chunks: Iterable, timeline: Timeline) -> Iterator:
    """`chunks` passed through, `timeline` fed with each."""
    for chunk in chunks:
        timeline.add(chunk)
        yield chunk


@dataclass(frozen=True)
class _Marks:
    """A whole utterance as one chunk: its samples' count and its marks (what `bulk` keeps)."""

    samples: range
    marks: tuple
    final: bool = True


def utterance_cues(length: int, marks: Iterable[tuple[int, str]]) -> list[Cue]:
    """The cues of one utterance of `length` samples with `marks` (an Utterance's)."""
    return cues([_Marks(range(length), tuple(marks))])


# -- files ------------------------------------------------------------------------------------------


def format_of(path: str) -> str:
    """`srt` or `vtt` from a caption file's name; anything else is a usage error."""
    fmt = Path(path).suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise OptionError(f"--captions {path}: the name must end in .srt or .vtt")
    return fmt


def check_target(path: str) -> str:
    """A caption file that can be written (files.check_target) -> its format; before any work."""
    fmt = format_of(path)
    files.check_target(path, "--captions")
    return fmt


def _clock(sample: int, sample_rate: int, sep: str) -> str:
    ms = (sample * 1000 + sample_rate // 2) // sample_rate  # nearest millisecond (monotonic in sample)
    s, ms = divmod(ms, 1000)
    m, s = divmod(s, 60)
    h, m = divmod(m, 60)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def render(cues: Iterable[Cue], fmt: str, sample_rate: int) -> str:
    """SRT (HH:MM:SS,mmm, cues numbered from 1) or WebVTT (the WEBVTT header, HH:MM:SS.mmm)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown caption format '{fmt}' (srt or vtt)")
    sep = "," if fmt == "srt" else "."
    blocks = ["WEBVTT\n"] if fmt == "vtt" else []
    for n, cue in enumerate(cues, 1):
        text = cue.text.replace("-->", "->")  # (the one sequence a cue's text may not hold in either)
        when = f"{_clock(cue.start, sample_rate, sep)} --> {_clock(cue.end, sample_rate, sep)}"
        blocks.append(f"{n}\n{when}\n{text}\n")
    return "\n".join(blocks)


def write(path: str, cues: Iterable[Cue], sample_rate: int, fmt: str | None = None) -> None:
    """The caption file, renamed into place once complete (as the audio files are)."""
    write_whole(Path(path).expanduser(), render(cues, fmt or format_of(path), sample_rate).encode("utf-8"))
