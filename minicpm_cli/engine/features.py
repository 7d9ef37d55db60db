"""Whisper log-mel features of 16 kHz audio, as the reference computes them for a voice (spec §1.6).

Samples in (a float32 tensor), features (n_mels, ceil(n / hop)) out: what transformers'
WhisperFeatureExtractor returns when MiniCPM-o's processor calls it, i.e. with `padding="max_length"`
(the audio zero-padded to 30 s) and the result cut to the frame count. The padding matters: the
dynamic-range floor (max - 8) is taken over every frame, the ones past those kept that still see the
end of the audio included, and the STFT's reflect padding reflects zeros (audio only at 30 s). Steps: centred STFT (Hann window, reflect padding), power, the Slaney mel filterbank
(0-8 kHz, area-normalised), log10 with a 1e-10 floor, the last frame dropped, the floor at max - 8,
then (x + 4) / 4. Settings come from the checkpoint's preprocessor_config.json (or Whisper's defaults).
This module knows tensors only: no files, resampling or models.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor


@dataclass(frozen=True)
class FeatureConfig:
    sample_rate: int = 16000
    n_fft: int = 400
    hop: int = 160
    n_mels: int = 80
    chunk_seconds: int = 30  # the padded length (WhisperFeatureExtractor's chunk_length)

    @property
    def max_samples(self) -> int:
        return self.chunk_seconds * self.sample_rate

    @classmethod
    def from_dir(cls, root: Path) -> "FeatureConfig":
        """From `root/preprocessor_config.json` where it exists (absent keys: Whisper's defaults)."""
        path = root / "preprocessor_config.json"
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            return cls()
        return cls(sample_rate=d.get("sampling_rate", 16000), n_fft=d.get("n_fft", 400),
                   hop=d.get("hop_length", 160), n_mels=d.get("feature_size", 80),
                   chunk_seconds=d.get("chunk_length", 30))

    def frames(self, n_samples: int) -> int:
        """Feature frames kept for n samples (the processor's attention-mask length)."""
        return math.ceil(n_samples / self.hop)


def _hz_to_mel(f: Tensor) -> Tensor:
    """Slaney's scale: linear below 1 kHz, logarithmic above."""
    logstep = 27.0 / math.log(6.4)
    return torch.where(f >= 1000.0, 15.0 + torch.log(f / 1000.0) * logstep, 3.0 * f / 200.0)


def _mel_to_hz(m: Tensor) -> Tensor:
    logstep = math.log(6.4) / 27.0
    return torch.where(m >= 15.0, 1000.0 * torch.exp(logstep * (m - 15.0)), 200.0 * m / 3.0)


def mel_filters(c: FeatureConfig, device=None) -> Tensor:
    """(n_fft // 2 + 1, n_mels) float32: triangles between Slaney-mel-spaced edges from 0 to 8 kHz,
    each scaled by 2 / its width in Hz (librosa's and transformers' `norm="slaney"`). Computed in
    float64, like theirs, then rounded once."""
    f64 = dict(dtype=torch.float64, device=device)
    edges = _mel_to_hz(torch.linspace(float(_hz_to_mel(torch.tensor(0.0, **f64))),
                                      float(_hz_to_mel(torch.tensor(8000.0, **f64))), c.n_mels + 2, **f64))
    fft_freqs = torch.linspace(0, c.sample_rate // 2, c.n_fft // 2 + 1, **f64)
    slopes = edges[None, :] - fft_freqs[:, None]  # (bins, n_mels + 2)
    widths = edges[1:] - edges[:-1]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    tri = torch.clamp(torch.minimum(down, up), min=0.0)
    return (tri * (2.0 / (edges[2:] - edges[:-2]))[None, :]).float()


def log_mel(samples: Tensor, c: FeatureConfig = FeatureConfig(), filters: Tensor | None = None) -> Tensor:
    """float32 samples (n,), n <= c.max_samples -> features (n_mels, ceil(n / hop))."""
    n = samples.shape[-1]
    if n > c.max_samples:
        raise ValueError(f"{n} samples: at most {c.max_samples} ({c.chunk_seconds} s) are encoded at once")
    x = torch.zeros(c.max_samples, dtype=torch.float32, device=samples.device)
    x[:n] = samples
    window = torch.hann_window(c.n_fft, device=x.device)
    stft = torch.stft(x, c.n_fft, c.hop, window=window, return_complex=True)  # (bins, frames + 1)
    power = (stft[:, :-1].abs() ** 2).contiguous()
    fb = mel_filters(c, x.device) if filters is None else filters
    spec = torch.clamp(fb.T @ power, min=1e-10).log10()  # (n_mels, frames)
    spec = torch.maximum(spec, spec.max() - 8.0)
    return ((spec + 4.0) / 4.0)[:, : c.frames(n)]
