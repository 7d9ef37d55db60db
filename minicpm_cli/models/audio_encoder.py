"""The audio encoder of MiniCPM-o 2.6: Whisper (`apm.*`), the projection into the LLM's embedding
space (`audio_projection_layer.*`) and average pooling over time (spec §1.6).

Log-mel features (B, n_mels, T) in, LLM input embeddings (B, T' // pool, llm_dim) out, T' = ceil(T/2):
conv1 (k3) and conv2 (k3, stride 2), each with the exact GELU; learned positions; pre-LayerNorm layers
(q/v/out projections with biases, k without) with a GELU MLP; a final LayerNorm (its output is what the
projection reads); then Linear, ReLU, Linear and AvgPool1d(pool, pool). `mask` (1|B, 1, T', T') is
True where an encoder frame may attend another: None is full attention (the reference's streaming
recipe), `chunk_mask` its `chat()` recipe. Parameter names follow the checkpoint. The module knows
nothing about audio files, features, prompts or devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .chattts import Projector

FRAMES_PER_SECOND = 50  # encoder frames: 100 feature frames a second (hop 160 at 16 kHz), conv2 stride 2


@dataclass(frozen=True)
class AudioEncoderConfig:
    dim: int  # d_model
    n_layers: int
    n_heads: int
    ffn: int
    n_mels: int
    max_positions: int  # encoder frames: 1500 = 30 s
    llm_dim: int
    pool: int  # audio_pool_step: encoder frames per LLM embedding
    chunk_frames: int  # encoder frames per chunk of the chunk-causal mask (audio_chunk_length s)
    norm_eps: float = 1e-5  # nn.LayerNorm's default, which Whisper keeps

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_hf(cls, cfg: dict) -> "AudioEncoderConfig":
        """From MiniCPM-o's config.json: `audio_config` (absent keys take WhisperConfig's defaults, as
        in the reference), the LLM width, `audio_pool_step` and `audio_chunk_length`."""
        a = cfg.get("audio_config") or {}
        return cls(
            dim=a.get("d_model", 384),
            n_layers=a.get("encoder_layers", 4),
            n_heads=a.get("encoder_attention_heads", 6),
            ffn=a.get("encoder_ffn_dim", 1536),
            n_mels=a.get("num_mel_bins", 80),
            max_positions=a.get("max_source_positions", 1500),
            llm_dim=cfg["hidden_size"],
            pool=cfg.get("audio_pool_step", 2),
            chunk_frames=int(cfg.get("audio_chunk_length", 1.0) * FRAMES_PER_SECOND),
        )


class Attention(nn.Module):
    def __init__(self, c: AudioEncoderConfig):
        super().__init__()
        self.n_heads, self.head_dim = c.n_heads, c.head_dim
        self.q_proj = nn.Linear(c.dim, c.dim, bias=True)
        self.k_proj = nn.Linear(c.dim, c.dim, bias=False)
        self.v_proj = nn.Linear(c.dim, c.dim, bias=True)
        self.out_proj = nn.Linear(c.dim, c.dim, bias=True)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, -1))


class EncoderLayer(nn.Module):
    def __init__(self, c: AudioEncoderConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.self_attn_layer_norm = nn.LayerNorm(c.dim, eps=c.norm_eps)
        self.fc1 = nn.Linear(c.dim, c.ffn)
        self.fc2 = nn.Linear(c.ffn, c.dim)
        self.final_layer_norm = nn.LayerNorm(c.dim, eps=c.norm_eps)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    """`apm.*`: features (B, n_mels, T) -> last hidden state after `layer_norm` (B, ceil(T/2), dim)."""

    def __init__(self, c: AudioEncoderConfig):
        super().__init__()
        self.conv1 = nn.Conv1d(c.n_mels, c.dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(c.dim, c.dim, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(c.max_positions, c.dim)
        self.layers = nn.ModuleList(EncoderLayer(c) for _ in range(c.n_layers))
        self.layer_norm = nn.LayerNorm(c.dim, eps=c.norm_eps)

    def forward(self, features: Tensor, mask: Tensor | None = None) -> Tensor:
        x = F.gelu(self.conv2(F.gelu(self.conv1(features))))  # (B, dim, T')
        x = x.transpose(1, 2)  # (B, T', dim)
        x = x + self.embed_positions.weight[: x.shape[1]]
        for layer in self.layers:
            x = layer(x, mask)
        return self.layer_norm(x)


class AudioEncoder(nn.Module):
    """Parameter names match the checkpoint's `apm.*` and `audio_projection_layer.*`."""

    def __init__(self, c: AudioEncoderConfig):
        super().__init__()
        self.config = c
        self.apm = WhisperEncoder(c)
        self.audio_projection_layer = Projector(c.dim, c.llm_dim)

    def pool(self, x: Tensor) -> Tensor:
        """(B, T', llm_dim) -> (B, T' // pool, llm_dim): the mean of each `pool` frames."""
        p = self.config.pool
        return F.avg_pool1d(x.transpose(1, 2), p, p).transpose(1, 2)

    def forward(self, features: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.pool(self.audio_projection_layer(self.apm(features, mask)))


def chunk_mask(n: int, chunk: int, dtype: torch.dtype, device=None) -> Tensor:
    """(1, 1, n, n) additive attention bias in `dtype`, 0 or -inf: frame i sees every frame of its own
    `chunk`-frame chunk and of all earlier chunks (the reference's `subsequent_chunk_mask` with all
    left chunks). A bias, not a boolean mask: on CUDA scaled_dot_product_attention keeps its fused
    kernel for it."""
    i = torch.arange(n, device=device)
    visible = (i[None, :] < (i[:, None] // chunk + 1) * chunk)[None, None]
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, float("-inf"))
