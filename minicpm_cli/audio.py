"""Writing audio: WAV/FLAC files (atomically: a complete file or none) and WAV bytes for stdout.

Float samples are converted to 16-bit PCM here (clipped to [-1, 1], scaled by 32767, rounded) rather
than by libsndfile, so the bytes do not depend on its clipping settings.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from .errors import UsageError

FORMATS = {".wav": "WAV", ".flac": "FLAC"}
PCM = {"s16": "PCM_16", "f32": "FLOAT"}


def file_format(path: str) -> str:
    if path == "-":
        return "WAV"
    fmt = FORMATS.get(Path(path).suffix.lower())
    if fmt is None:
        raise UsageError(f"cannot tell the audio format of '{path}': use a .wav or .flac name, or - for stdout")
    return fmt


def check_output(path: str, pcm: str) -> str:
    """Validate an output target before any work is done; returns the soundfile format."""
    if pcm not in PCM:
        raise UsageError(f"unknown --pcm '{pcm}' (use s16 or f32)")
    fmt = file_format(path)
    if fmt == "FLAC" and pcm == "f32":
        raise UsageError("FLAC stores integer samples: use --pcm s16, or a .wav file for float samples")
    if path != "-":
        parent = Path(path).expanduser().resolve().parent
        if not parent.is_dir():
            raise UsageError(f"output directory does not exist: {parent}")
    return fmt


def to_pcm(audio: np.ndarray, pcm: str) -> np.ndarray:
    audio = np.asarray(audio, dtype=np.float32)
    if pcm == "f32":
        return audio
    return np.round(np.clip(audio, -1.0, 1.0) * 32767.0).astype(np.int16)


def encode(audio: np.ndarray, sample_rate: int, fmt: str, pcm: str) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, to_pcm(audio, pcm), sample_rate, format=fmt, subtype=PCM[pcm])
    return buf.getvalue()


def write(path: str, audio: np.ndarray, sample_rate: int, pcm: str = "s16") -> None:
    """Write to `path` (or stdout for '-'): a temporary file renamed into place when complete."""
    fmt = check_output(path, pcm)
    data = encode(audio, sample_rate, fmt, pcm)
    if path == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    target = Path(path).expanduser()
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.resolve().parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
