"""The conditional ChatTTS head of MiniCPM-o 2.6 (`tts.*` in the checkpoint, DVAE excluded).

A Llama backbone over a fixed layout of condition slots (text, speaker vector) followed by audio
frames. Inputs are embeddings: BERT text ids through `emb_text`, audio frames as the sum of the four
codebook embeddings, and the LLM speaker hidden state through the projector + L2 normalisation. The
four weight-normed code heads are folded into one plain weight `(num_vq, num_audio_tokens, hidden)`
at load time. Generation order, masks and sampling live in `minicpm_cli.engine.tts`, not here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .transformer import Decoder, DecoderConfig, Embedding


@dataclass(frozen=True)
class TTSConfig:
    decoder: DecoderConfig
    llm_dim: int
    num_audio_tokens: int = 626  # 5**4 FSQ codes + EOS
    num_text_tokens: int = 21178
    num_vq: int = 4
    spk_emb_token_id: int = 21143  # [spk_emb]
    audio_bos_token_id: int = 21132  # [Ptts]
    text_eos_token_id: int = 21133  # [Etts]
    streaming_text_chunk_size: int = 10
    streaming_text_reserved_len: int = 300
    top_p: float = 0.7
    top_k: int = 20

    @property
    def eos_code(self) -> int:
        return self.num_audio_tokens - 1

    @property
    def condition_length(self) -> int:
        """[Stts] + [spk_emb] + reserved text slots + [Ptts]: 303 for the real model."""
        return 1 + 1 + self.streaming_text_reserved_len + 1

    @classmethod
    def from_hf(cls, tts: dict) -> "TTSConfig":
        """From config.json's `tts_config`; absent keys take ConditionalChatTTSConfig's defaults."""
        dim = tts.get("hidden_size", 768)
        n_heads = tts.get("num_attention_heads", 12)
        known = {f for f in cls.__dataclass_fields__ if f not in ("decoder", "llm_dim")}
        return cls(
            decoder=DecoderConfig(
                dim=dim,
                n_layers=tts.get("num_hidden_layers", 20),
                n_heads=n_heads,
                n_kv_heads=tts.get("num_key_value_heads", n_heads),
                intermediate=tts.get("intermediate_size", 3072),
                rope_theta=float(tts.get("rope_theta", 10000.0)),
                norm_eps=float(tts.get("rms_norm_eps", 1e-6)),
                qkv_bias=False,
                max_positions=tts.get("max_position_embeddings", 4096),
            ),
            llm_dim=tts.get("llm_dim", 3584),
            **{k: v for k, v in tts.items() if k in known},
        )


class Projector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim, bias=True)
        self.linear2 = nn.Linear(out_dim, out_dim, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(F.relu(self.linear1(x)))


class UnitNorm(nn.Module):
    """The speaker vector's L2 normalisation (`F.normalize` over the last dim), a module so that a
    backend can run it on a kernel of its own (backends/invariant.py: a program a row)."""

    eps = 1e-12

    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(x, p=2, dim=-1, eps=self.eps)


class ChatTTS(nn.Module):
    """Parameter names match the checkpoint with `tts.` removed, except `heads` (folded head_code)."""

    def __init__(self, c: TTSConfig):
        super().__init__()
        self.config = c
        h = c.decoder.dim
        self.projector = Projector(c.llm_dim, h)
        self.unit = UnitNorm()
        self.emb_text = Embedding(c.num_text_tokens, h)
        self.emb_code = nn.ModuleList(Embedding(c.num_audio_tokens, h) for _ in range(c.num_vq))
        self.heads = nn.Parameter(torch.empty(c.num_vq, c.num_audio_tokens, h))
        self.model = Decoder(c.decoder)

    def speaker(self, llm_hidden: Tensor) -> Tensor:
        """LLM hidden state at <|spk|> (..., llm_dim) -> unit-norm speaker vector (..., hidden)."""
        return self.unit(self.projector(llm_hidden))

    def embed_text(self, ids: Tensor, spk: Tensor | None = None) -> Tensor:
        """ids (T,) -> (1, T, hidden); the [spk_emb] slots take the speaker vector when given."""
        x = self.emb_text(ids)
        if spk is not None:
            is_spk = (ids == self.config.spk_emb_token_id)[:, None]
            x = torch.where(is_spk, spk.to(x.dtype).reshape(1, -1), x)
        return x[None]

    def embed_codes(self, codes: Tensor) -> Tensor:
        """codes (..., num_vq) -> (..., hidden): the sum of the per-codebook embeddings."""
        return torch.stack([emb(codes[..., q]) for q, emb in enumerate(self.emb_code)], -1).sum(-1)

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden (..., h) -> float32 logits (..., num_vq, num_audio_tokens)."""
        return torch.einsum("...h,qvh->...qv", hidden, self.heads).float()


def fold_weight_norm(g: Tensor, v: Tensor) -> Tensor:
    """weight_norm(dim=0): W[j] = g[j] * v[j] / ||v[j]||, computed as torch's parametrization does."""
    return torch._weight_norm(v, g, 0)
