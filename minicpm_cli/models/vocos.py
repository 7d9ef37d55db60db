"""The Vocos vocoder as MiniCPM-o 2.6 builds it (vocos 0.1.0, `assets/Vocos.pt`): log-mel -> waveform.

In: a natural-log magnitude mel (B, n_mels, F), e.g. the DVAE's output. Out: audio (B, hop * F) at
24 kHz. A ConvNeXt backbone predicts per frame a log-magnitude and a phase for each of n_fft/2+1
bins; an inverse STFT with "same" padding (vocos's custom ISTFT, not `torch.istft`, whose NOLA check
rejects it) turns them into samples. Names of parameters and of the `head.istft.window` buffer are
the keys of `Vocos.pt`; its `feature_extractor.*` entries (mel analysis) are not used for decoding.
Run it in float32: the reference does, and the exp/ISTFT amplify low-precision errors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class VocosConfig:
    dim: int = 512
    intermediate_dim: int = 1536
    num_layers: int = 8
    n_mels: int = 100
    n_fft: int = 1024
    hop: int = 256

    @classmethod
    def from_state_dict(cls, sd: dict[str, Tensor]) -> "VocosConfig":
        """Sizes from tensor shapes; the hop length is not stored and keeps the reference's 256."""
        dim, n_mels, _ = sd["backbone.embed.weight"].shape
        layers = r"backbone\.convnext\.(\d+)\.dwconv\.weight"
        return cls(
            dim=dim,
            intermediate_dim=sd["backbone.convnext.0.pwconv1.weight"].shape[0],
            num_layers=1 + max(int(m[1]) for k in sd if (m := re.fullmatch(layers, k))),
            n_mels=n_mels,
            n_fft=sd["head.istft.window"].shape[0],
        )


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, intermediate: int):
        super().__init__()
        self.dwconv = nn.Conv1d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, intermediate)
        self.pwconv2 = nn.Linear(intermediate, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:  # (B, C, F)
        y = self.norm(self.dwconv(x).transpose(1, 2))  # (B, F, C)
        y = self.gamma * self.pwconv2(F.gelu(self.pwconv1(y)))
        return x + y.transpose(1, 2)


class Backbone(nn.Module):
    def __init__(self, c: VocosConfig):
        super().__init__()
        self.embed = nn.Conv1d(c.n_mels, c.dim, 7, padding=3)
        self.norm = nn.LayerNorm(c.dim, eps=1e-6)
        self.convnext = nn.ModuleList(ConvNeXtBlock(c.dim, c.intermediate_dim) for _ in range(c.num_layers))
        self.final_layer_norm = nn.LayerNorm(c.dim, eps=1e-6)

    def forward(self, mel: Tensor) -> Tensor:
        x = self.norm(self.embed(mel).transpose(1, 2)).transpose(1, 2)  # (B, C, F)
        for block in self.convnext:
            x = block(x)
        return self.final_layer_norm(x.transpose(1, 2))  # (B, F, C)


class ISTFT(nn.Module):
    def __init__(self, c: VocosConfig):
        super().__init__()
        self.n_fft, self.hop = c.n_fft, c.hop
        self.register_buffer("window", torch.hann_window(c.n_fft))
        # 0 at the DC and Nyquist bins, 1 elsewhere: their imaginary parts, dropped (below)
        keep = torch.ones(c.n_fft // 2 + 1)
        keep[0] = keep[-1] = 0
        self.register_buffer("imag_keep", keep[:, None], persistent=False)

    def forward(self, spec: Tensor) -> Tensor:
        """spec (B, n_fft/2+1, F) complex -> (B, hop * F)."""
        n, frames = self.n_fft, spec.shape[-1]
        # The inverse real FFT takes the DC and Nyquist bins as real, as a real signal's are; the
        # head's are not. pocketfft (CPU, the reference's goldens) drops their imaginary parts; cuFFT
        # does for one row but not in a batch of 8 (4.7e-3 off, H100, float32). Dropped here, every
        # device and batch size gives the reference's samples.
        spec = torch.complex(spec.real, spec.imag * self.imag_keep)
        pad = (n - self.hop) // 2
        fold = dict(output_size=(1, (frames - 1) * self.hop + n), kernel_size=(1, n), stride=(1, self.hop))
        frames_t = torch.fft.irfft(spec, n, dim=1, norm="backward") * self.window[None, :, None]  # (B, n, F)
        y = F.fold(frames_t, **fold)[:, 0, 0, pad:-pad]
        envelope = F.fold(self.window.square().expand(1, frames, -1).transpose(1, 2), **fold)[0, 0, 0, pad:-pad]
        return y / envelope


class Head(nn.Module):
    def __init__(self, c: VocosConfig):
        super().__init__()
        self.out = nn.Linear(c.dim, c.n_fft + 2)
        self.istft = ISTFT(c)

    def forward(self, x: Tensor) -> Tensor:
        mag, phase = self.out(x).transpose(1, 2).chunk(2, dim=1)  # 2 x (B, n_fft/2+1, F)
        mag = torch.clip(torch.exp(mag), max=1e2)  # vocos's guard against huge magnitudes
        # Built as vocos builds it (not torch.polar) so the complex values match bit for bit.
        return self.istft(mag * (torch.cos(phase) + 1j * torch.sin(phase)))


class Vocos(nn.Module):
    def __init__(self, c: VocosConfig):
        super().__init__()
        self.config = c
        self.backbone = Backbone(c)
        self.head = Head(c)

    def forward(self, mel: Tensor) -> Tensor:
        """mel (B, n_mels, F) -> audio (B, hop * F)."""
        return self.head(self.backbone(mel))
