"""Audio sinks: where the chunks of `Synthesizer.synthesize/reply` go, written as they arrive.

- `FileSink`: a .wav or .flac file (where the name is a link, the file it points to), written to a
  temporary name in the same directory and renamed into place when complete, so an error, Ctrl-C or
  kill leaves no file or a complete one. 16-bit WAV is written here (header and samples), FLAC and
  float WAV by libsndfile.
- `WavStreamSink`: WAV to a byte stream (stdout): a header whose sizes say "unknown length"
  (0xFFFFFFFF, as streaming tools write it), written with the first samples (an error before them
  leaves nothing on the stream), then samples, flushed per chunk. Where the stream is a regular
  file (`say "Hi." > hi.wav`), its sizes are written into the header at the end, as a file's.
- `RawSink`: headerless PCM (s16le or f32le), flushed per chunk.

A target that exists and is neither a regular file nor a directory (a named pipe, a device such as
/dev/null: `is_stream`) is written in place as stdout is, WAV or raw, never replaced; so is a
descriptor's name (/dev/stdout, /dev/fd/N), through a copy of the descriptor, whatever it points to.

Float samples become 16-bit PCM here (clipped to [-1, 1], scaled by 32767, rounded), not in
libsndfile, so the bytes do not depend on its settings. The raw, streaming and 16-bit WAV sinks also
take `Pcm`: samples already converted by `to_pcm` (a server's, when the thin client asks it for the
sink's own format), written as they are.
"""

from __future__ import annotations

import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol

from .errors import OptionError, UsageError
from .files import check_writable, new_file_mode, temporary

if TYPE_CHECKING:
    import numpy as np

FORMATS = {".wav": "WAV", ".flac": "FLAC"}
PCM = {"s16": "PCM_16", "f32": "FLOAT"}
PCM_BYTES = {"s16": 2, "f32": 4}


class Sink(Protocol):
    def write(self, samples: np.ndarray) -> None: ...
    def close(self) -> None: ...
    def abort(self) -> None: ...


def check_pcm(pcm: str) -> None:
    if pcm not in PCM:
        raise OptionError(f"unknown --pcm '{pcm}' (use s16 or f32)")


def make_directory(directory: str | os.PathLike) -> Path:
    """An output directory, made (with its parents) when missing and checked writable."""
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot make the directory {directory}: {e.strerror or e}") from None
    check_writable(path)
    return path


def file_format(path: str) -> str:
    fmt = FORMATS.get(Path(path).suffix.lower())
    if fmt is None:
        raise OptionError(f"cannot tell the audio format of '{path}': use a .wav or .flac name, --raw for "
                          "headerless PCM, or - for stdout")
    return fmt


def descriptor(path: str) -> int | None:
    """The descriptor a name such as /dev/stdout or /dev/fd/3 stands for (written through a copy of
    it, as `-o -` writes stdout, even where it is a regular file: `> f.wav`, `>> log`; opening the
    name would truncate such a file), else None."""
    name = {"/dev/stdout": "/dev/fd/1", "/dev/stderr": "/dev/fd/2"}.get(path, path)
    for prefix in ("/dev/fd/", "/proc/self/fd/"):
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            return int(name[len(prefix):])
    return None


def is_stream(path: str) -> bool:
    """Whether the output `path` is written as a stream, in place: stdout (-), an open descriptor's
    name, or a file that exists and is neither a regular file nor a directory (a named pipe, a
    device)."""
    if path == "-":
        return True
    target = Path(path).expanduser()
    if not target.exists() or target.is_dir():
        return False
    return not target.is_file() or descriptor(path) is not None


def check_output(path: str, pcm: str, raw: bool = False, probe: bool = True) -> None:
    """Validate an output target before any work is done; with `probe`, that its directory takes a
    new file (once, before any work: a sink's own temporary file is the check at opening)."""
    check_pcm(pcm)
    if path == "-":
        if sys.stdout is None:  # (`>&-`: Python has no stdout to give)
            raise UsageError("standard output is closed: give -o FILE")
        return
    target = Path(path).expanduser()
    if target.is_dir():
        raise UsageError(f"{path} is a directory: name a file in it (e.g. {target / 'out.wav'})")
    if raw and target.suffix.lower() in FORMATS:
        raise OptionError(f"--raw writes headerless PCM, not {FORMATS[target.suffix.lower()]}: drop --raw, or name "
                          f"the file for what it holds (e.g. {target.with_suffix('.raw').name})")
    if is_stream(path):  # (WAV or raw, whatever its name: /dev/stdout has none)
        if not raw and target.suffix.lower() == ".flac":
            raise OptionError(f"{path} is not a regular file: it takes WAV or --raw PCM written as a stream, "
                              "not FLAC")
        return
    if not raw and file_format(path) == "FLAC" and pcm == "f32":
        raise OptionError("FLAC stores integer samples: use --pcm s16, or a .wav file for float samples")
    parent = target.resolve().parent
    if not parent.is_dir():
        raise UsageError(f"output directory does not exist: {parent}")
    if probe:
        check_writable(parent)


def takes_pcm(path: str, pcm: str, raw: bool = False) -> bool:
    """Whether the sink `open_sink` opens for these writes `Pcm` as it is: raw, streamed, or a 16-bit
    WAV file (a server is asked for those bytes; FLAC and float WAV files go through libsndfile)."""
    return raw or is_stream(path) or (file_format(path) == "WAV" and pcm == "s16")


def to_pcm(samples: np.ndarray, pcm: str) -> np.ndarray:
    import numpy as np  # (here, not at the top: `say` through a server sends its request before numpy loads)

    samples = np.asarray(samples, dtype=np.float32)
    if pcm == "f32":
        return samples
    return np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)


@dataclass(frozen=True)
class Pcm:
    """Samples as a raw sink writes them: `to_pcm`'s bytes, s16le or f32le. `len()` counts samples."""

    data: bytes
    pcm: str  # "s16" or "f32"

    def __len__(self) -> int:
        return len(self.data) // PCM_BYTES[self.pcm]


def wav_header(sample_rate: int, pcm: str, data_bytes: int = 0xFFFFFFFF) -> bytes:
    """A 44-byte WAV header; the default sizes mean "until the end of the stream"."""
    fmt_tag, bits = (1, 16) if pcm == "s16" else (3, 32)
    riff = 0xFFFFFFFF if data_bytes == 0xFFFFFFFF else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, fmt_tag, 1, sample_rate, sample_rate * bits // 8, bits // 8, bits)
            + b"data" + struct.pack("<I", data_bytes))


class RawSink:
    def __init__(self, stream: BinaryIO, pcm: str, owned: bool = False):
        self.stream, self.pcm = stream, pcm
        self.owned = owned  # (a stream the sink opened, and closes)
        self.written = 0  # sample bytes

    def write(self, samples: np.ndarray | Pcm) -> None:
        if isinstance(samples, Pcm):
            if samples.pcm != self.pcm:
                raise ValueError(f"{samples.pcm} samples for a {self.pcm} sink")
            data = samples.data
        else:
            data = to_pcm(samples, self.pcm).astype("<i2" if self.pcm == "s16" else "<f4").tobytes()
        self.stream.write(data)
        self.stream.flush()
        self.written += len(data)

    def close(self) -> None:
        self.stream.flush()
        if self.owned:
            self.stream.close()

    def abort(self) -> None:
        if self.owned:
            try:
                self.stream.close()
            except OSError:  # (what was left in its buffer has nowhere to go: the reader is gone)
                pass


class WavStreamSink(RawSink):
    def __init__(self, stream: BinaryIO, pcm: str, sample_rate: int, owned: bool = False):
        super().__init__(stream, pcm, owned)
        self.rate = sample_rate
        self.header_at: int | None = None  # the header's offset in a regular file, once written there
        self.started = False

    def write(self, samples: np.ndarray | Pcm) -> None:
        self._start()
        super().write(samples)

    def close(self) -> None:
        self._start()  # (no samples: an empty WAV)
        self.stream.flush()
        if self.header_at is not None and self.written <= 0xFFFFFFFF - 36:
            fd = self.stream.fileno()
            os.pwrite(fd, struct.pack("<I", 36 + self.written), self.header_at + 4)
            os.pwrite(fd, struct.pack("<I", self.written), self.header_at + 40)
        super().close()

    def _start(self) -> None:
        if not self.started:
            self.started = True
            self.stream.flush()
            self.header_at = _file_offset(self.stream)
            self.stream.write(wav_header(self.rate, self.pcm))
            self.stream.flush()


def _file_offset(stream: BinaryIO) -> int | None:
    """Where the next byte goes in `stream`, if it is a regular file that can be written at a place
    (not opened to append: `>>`, where every write goes to the end); else None (a pipe, a terminal)."""
    import fcntl
    import stat

    try:
        fd = stream.fileno()
        if not stat.S_ISREG(os.fstat(fd).st_mode) or fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND:
            return None
        return os.lseek(fd, 0, os.SEEK_CUR)
    except (OSError, ValueError, AttributeError):  # (no descriptor: a test's BytesIO)
        return None


class FileSink:
    def __init__(self, path: str, pcm: str, sample_rate: int, raw: bool = False):
        # (a link's target is the file replaced, as files.write_whole does: the link stays, and the
        # temporary file, made beside the target, is renamed within its own file system)
        self.target = Path(os.path.realpath(Path(path).expanduser()))
        fd, self.tmp = temporary(self.target)
        os.close(fd)
        self.pcm, self.rate = pcm, None
        if takes_pcm(path, pcm, raw):
            # raw, or a 16-bit WAV written here: its 44-byte header is the one libsndfile writes, byte for
            # byte (a test checks), and samples a server converted (`Pcm`) need neither numpy nor libsndfile
            self.file = None
            self.raw = RawSink(open(self.tmp, "wb"), pcm)
            if not raw:
                self.rate = sample_rate
                self.raw.stream.write(wav_header(sample_rate, pcm, 0))
        else:
            import soundfile as sf

            self.raw = None
            self.file = sf.SoundFile(self.tmp, "w", samplerate=sample_rate, channels=1,
                                     format=file_format(path), subtype=PCM[pcm])

    def write(self, samples: np.ndarray | Pcm) -> None:
        if self.raw:
            self.raw.write(samples)
        else:
            self.file.write(to_pcm(samples, self.pcm))

    def close(self) -> None:
        if self.raw:
            if self.rate is not None:  # the WAV header's sizes, now known
                size = self.raw.stream.tell() - 44
                self.raw.stream.seek(0)
                self.raw.stream.write(wav_header(self.rate, self.pcm, size))
            self.raw.stream.close()
        else:
            self.file.close()
            if self.file.format == "WAV":
                _unstamp_peak(self.tmp)
        os.chmod(self.tmp, new_file_mode())  # mkstemp makes 0600; give the file the usual permissions
        os.replace(self.tmp, self.target)

    def abort(self) -> None:
        try:
            (self.raw.stream if self.raw else self.file).close()
        finally:
            Path(self.tmp).unlink(missing_ok=True)


def _unstamp_peak(path: str) -> None:
    """Zero the write time libsndfile stamps into a float WAV's PEAK chunk (its version, then the time,
    then each channel's peak), so that the same samples give the same file, byte for byte, whenever
    they are written. The chunks before `data` are walked; a file without a PEAK chunk is left as is."""
    with open(path, "r+b") as f:
        at = 12  # (past "RIFF", its size and "WAVE")
        while True:
            f.seek(at)
            head = f.read(8)
            if len(head) < 8 or head[:4] == b"data":
                return
            size = struct.unpack("<I", head[4:])[0]
            if head[:4] == b"PEAK" and size >= 8:
                f.seek(at + 12)
                f.write(bytes(4))
                return
            at += 8 + size + (size & 1)  # (chunks are padded to an even size)


def open_sink(path: str, pcm: str, sample_rate: int, raw: bool = False) -> Sink:
    check_output(path, pcm, raw, probe=False)
    if path == "-":
        out = sys.stdout.buffer
        return RawSink(out, pcm) if raw else WavStreamSink(out, pcm, sample_rate)
    if is_stream(path):  # (a named pipe, a device or a descriptor, written in place as stdout is)
        fd = descriptor(path)
        out = open(Path(path).expanduser(), "wb") if fd is None else os.fdopen(os.dup(fd), "wb")
        return RawSink(out, pcm, owned=True) if raw else WavStreamSink(out, pcm, sample_rate, owned=True)
    return FileSink(path, pcm, sample_rate, raw)
