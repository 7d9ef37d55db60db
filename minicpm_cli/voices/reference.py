"""Reference voices: audio in, checked 16 kHz mono float32 samples out.

`load_reference(path)` reads any format soundfile (libsndfile) reads (wav, flac, ogg, ...) the way the
reference's recipe does with `librosa.load(path, sr=16000, mono=True)`: float32 samples, channels
averaged, resampled with soxr (high quality) to the length librosa gives, ceil(n * 16000 / rate). A
16 kHz mono float file comes back bit for bit. `Voice` holds such samples and a name for messages; it
is what the Python API, a saved-voice store and a server pass around. A voice that cannot be used is a
`VoiceError` naming the file (or the voice) and the limit: unreadable, not audio, longer than 30 s,
shorter than 0.5 s, silent (peak below 1e-3), or with NaN/infinite samples.

This module needs numpy, soundfile and soxr, not torch (the thin client may read references too).
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from ..errors import VoiceError

SAMPLE_RATE = 16000  # what the audio encoder's features are computed at
MIN_SECONDS = 0.5
MAX_SECONDS = 30.0  # the encoder's positions cover 30 s (1500 frames)
MIN_PEAK = 1e-3  # below this the reference is taken for silence


@dataclass(frozen=True, eq=False)
class Voice:
    """A reference voice: `samples` are 16 kHz mono float32 (checked, copied and made read-only at
    construction), `name` says which voice in messages (a file name, a stored voice's name)."""

    samples: np.ndarray
    name: str = "the reference audio"

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", check_samples(self.samples, self.name))

    @classmethod
    def load(cls, source: str | os.PathLike | BinaryIO, name: str | None = None) -> "Voice":
        name = name or _name_of(source)
        return cls(load_reference(source, name=name), name)

    @property
    def seconds(self) -> float:
        return len(self.samples) / SAMPLE_RATE

    @functools.cached_property
    def digest(self) -> str:
        """A content hash of the samples: equal voices share cached encodings."""
        return hashlib.sha256(self.samples.tobytes()).hexdigest()[:32]


def as_voice(voice: "Voice | np.ndarray | None") -> Voice | None:
    """A `Voice` from what the API accepts: a Voice, 16 kHz mono float samples, or None."""
    if voice is None or isinstance(voice, Voice):
        return voice
    if isinstance(voice, np.ndarray):
        return Voice(voice)
    raise VoiceError(f"a voice is a minicpm_cli.voices.reference.Voice or a numpy array of 16 kHz samples, "
                     f"not {type(voice).__name__}")


def check_samples(samples: np.ndarray, name: str = "the reference audio") -> np.ndarray:
    """A read-only float32 copy of 16 kHz mono samples, or a VoiceError saying what is wrong."""
    a = np.asarray(samples)
    if a.ndim != 1:
        raise VoiceError(f"{name}: expected mono samples (one dimension), got an array of shape {a.shape}")
    if not np.issubdtype(a.dtype, np.floating):
        raise VoiceError(f"{name}: expected float samples in [-1, 1], got {a.dtype}")
    a = np.array(a, dtype=np.float32, copy=True)
    seconds = len(a) / SAMPLE_RATE
    if seconds < MIN_SECONDS:
        raise VoiceError(f"{name}: {seconds:.2f} s of audio; a reference voice needs at least {MIN_SECONDS} s")
    if seconds > MAX_SECONDS:
        raise VoiceError(f"{name}: {seconds:.1f} s of audio; a reference voice may be at most "
                         f"{MAX_SECONDS:.0f} s (trim it)")
    if not np.isfinite(a).all():
        raise VoiceError(f"{name}: the audio has NaN or infinite samples")
    peak = float(np.abs(a).max())
    if peak < MIN_PEAK:
        raise VoiceError(f"{name}: the audio is silent (peak {peak:.1e}, below {MIN_PEAK:g})")
    a.flags.writeable = False
    return a


def load_reference(source: str | os.PathLike | BinaryIO, name: str | None = None) -> np.ndarray:
    """Read a reference recording -> checked 16 kHz mono float32 samples (see the module's contract).
    `source` is a path or a binary file object; `name` replaces the path in messages."""
    import soundfile as sf

    name = name or _name_of(source)
    if not hasattr(source, "read"):
        path = os.fspath(source)
        if not os.path.exists(path):
            raise VoiceError(f"{name}: no such file")
        if os.path.isdir(path):
            raise VoiceError(f"{name}: is a directory, not an audio file")
        if not os.access(path, os.R_OK):
            raise VoiceError(f"{name}: cannot read the file (permission denied)")
        if not os.path.isfile(path):  # (a pipe, `<(ffmpeg ...)` or /dev/stdin: soundfile would read it twice)
            source = _read_pipe(path, name)
    try:
        start = source.tell() if hasattr(source, "read") else None
        info = sf.info(source)
        if start is not None:
            source.seek(start)
    except (sf.SoundFileError, RuntimeError, TypeError, ValueError, OSError):
        raise VoiceError(f"{name}: not audio that soundfile can read (wav, flac, ogg, ...)") from None
    if info.duration > MAX_SECONDS:
        raise VoiceError(f"{name}: {info.duration:.1f} s of audio; a reference voice may be at most "
                         f"{MAX_SECONDS:.0f} s (trim it)")
    try:
        data, rate = sf.read(source, dtype="float32", always_2d=True)  # (frames, channels)
    except (sf.SoundFileError, RuntimeError, OSError) as e:
        raise VoiceError(f"{name}: cannot decode the audio ({e})") from None
    mono = data[:, 0] if data.shape[1] == 1 else data.mean(axis=1, dtype=np.float32)
    if rate != SAMPLE_RATE and len(mono):
        mono = _resample(mono, rate)
    return check_samples(mono, name)


PIPE_BYTES = 64 << 20  # what a pipe may hold: 30 s of 192 kHz stereo float is 46 MB


def _read_pipe(path: str, name: str) -> io.BytesIO:
    """All a pipe (or another file that is not a regular one) holds, read once, as a file in memory."""
    try:
        with open(path, "rb") as f:
            data = f.read(PIPE_BYTES + 1)
    except OSError as e:
        raise VoiceError(f"{name}: cannot read it ({e.strerror or e})") from None
    if len(data) > PIPE_BYTES:
        raise VoiceError(f"{name}: more than {PIPE_BYTES >> 20} MiB of audio; a reference voice may be at most "
                         f"{MAX_SECONDS:.0f} s (trim it)")
    return io.BytesIO(data)


def _resample(x: np.ndarray, rate: int) -> np.ndarray:
    """soxr's high-quality resampler, then padded or trimmed to ceil(n * 16000 / rate) samples as
    librosa.resample does (the reference loads voices with librosa)."""
    import soxr

    y = soxr.resample(x, rate, SAMPLE_RATE, quality="HQ")
    n = -(-len(x) * SAMPLE_RATE // rate)
    if len(y) < n:
        y = np.pad(y, (0, n - len(y)))
    return np.ascontiguousarray(y[:n], dtype=np.float32)


def _name_of(source) -> str:
    if hasattr(source, "read"):
        return str(getattr(source, "name", None) or "the reference audio")
    return os.fspath(source)
