"""Audio as the API sends it: whole files, raw samples, server-sent events.

Contract: the bytes are the command's. `encode` is the file `minicpm say -o FILE` writes (16-bit
samples converted by `audio.to_pcm`), `raw` what `say -o -` / `audio.RawSink` streams (s16le, or
f32le for `pcm_f32`), `sse` one event's `data:` block. `writable_formats` says which response formats
the installed libsndfile can write (and why not, for those it cannot).
"""

from __future__ import annotations

import io
import json

import numpy as np
import soundfile as sf

from .. import protocol
from ..audio import to_pcm

FILES = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"),
         "opus": ("OGG", "OPUS")}  # whole files: soundfile's format and subtype
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "pcm_f32": "audio/pcm", "flac": "audio/flac",
               "mp3": "audio/mpeg", "opus": "audio/ogg"}


def writable_formats() -> dict[str, str | None]:
    """Each response format -> None if this libsndfile can write it, else why not."""
    out: dict[str, str | None] = {name: None for name in (*protocol.STREAMABLE, *protocol.ENCODED)}
    for name in protocol.ENCODED:
        try:
            encode(np.zeros(2400, dtype=np.float32), name, 24000)
        except Exception as e:  # (soundfile raises its own types, or TypeError/ValueError)
            out[name] = f"the installed libsndfile ({sf.__libsndfile_version__}) cannot write {name}: {e}"
    return out


def encode(samples: np.ndarray, fmt: str, sample_rate: int) -> bytes:
    """A whole file, as `say -o FILE` writes it (16-bit samples converted as audio.to_pcm does)."""
    kind, subtype = FILES[fmt]
    data = to_pcm(samples, "s16") if subtype == "PCM_16" else np.clip(samples, -1.0, 1.0).astype(np.float32)
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", samplerate=sample_rate, channels=1, format=kind, subtype=subtype) as f:
        f.write(data)
    return buf.getvalue()


def raw(samples: np.ndarray, fmt: str) -> bytes:
    """Streamed samples: s16le for wav and pcm, f32le for pcm_f32 (audio.RawSink's bytes)."""
    pcm = protocol.RAW_FORMATS.get(fmt, "s16")
    return to_pcm(samples, pcm).astype("<i2" if pcm == "s16" else "<f4").tobytes()


def sse(event: dict) -> bytes:
    """One server-sent event: `data: ` and the event as compact JSON."""
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
