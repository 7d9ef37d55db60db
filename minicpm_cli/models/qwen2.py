"""The Qwen2 LLM of MiniCPM-o 2.6 (`llm.*` in the checkpoint).

Token ids (for a voice, with audio embeddings in place of some of theirs) in, `(logits, hidden)` out,
where `hidden` is the post-final-RMSNorm last-layer state that `lm_head` reads and that conditions
the TTS at the `<|spk|>` position. q/k/v carry biases, KV heads are grouped, RoPE theta comes from
config.json and `lm_head` is not tied to the embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from .transformer import Decoder, DecoderConfig


@dataclass(frozen=True)
class Qwen2Config:
    decoder: DecoderConfig
    vocab_size: int

    @classmethod
    def from_hf(cls, cfg: dict) -> "Qwen2Config":
        """From the top level of MiniCPM-o's config.json (the LLM fields live there)."""
        dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        return cls(
            decoder=DecoderConfig(
                dim=dim,
                n_layers=cfg["num_hidden_layers"],
                n_heads=n_heads,
                n_kv_heads=cfg.get("num_key_value_heads", n_heads),
                intermediate=cfg["intermediate_size"],
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                qkv_bias=True,
                max_positions=cfg.get("max_position_embeddings", 32768),
            ),
            vocab_size=cfg["vocab_size"],
        )


class Qwen2LM(nn.Module):
    """Parameter names match the checkpoint with the `llm.` prefix removed."""

    def __init__(self, c: Qwen2Config):
        super().__init__()
        self.config = c
        self.model = Decoder(c.decoder, vocab_size=c.vocab_size)
        self.lm_head = nn.Linear(c.decoder.dim, c.vocab_size, bias=False)

    def forward(self, ids: Tensor, input_pos: Tensor, mask: Tensor | None = None, kv_len: int = 0,
                logits_at: slice | None = slice(-1, None), block_fns: tuple | None = None,
                embeds: Tensor | None = None, embed_at: Tensor | None = None,
                rows=None, inputs: Tensor | None = None) -> tuple[Tensor | None, Tensor]:
        """ids (B, T) -> logits (B, T', vocab) for the positions in `logits_at`, hidden (B, T, dim).
        `embeds` (B, k, dim) replace the input embeddings of the k positions `embed_at` (k,): audio
        embeddings in their placeholders. `inputs` (B, T, dim): the input embeddings themselves, in
        place of `ids`'. `rows`: the KV-cache rows of the B sequences (Decoder)."""
        x = self.model.embed_tokens(ids) if inputs is None else inputs
        if embeds is not None:
            x = x.index_copy(1, embed_at, embeds.to(x.dtype))
        hidden = self.model(x, input_pos, mask, kv_len, block_fns, rows)
        logits = None if logits_at is None else self.lm_head(hidden[:, logits_at]).float()
        return logits, hidden
