"""A reference voice in the LLM context (spec §1.6, §4.3-4.5): the prompt turn that carries it, and
the audio encoder's embeddings for its placeholders.

`VoiceEncoder.turn(voice, mode)` gives a `VoiceTurn`: the token ids of the turn, with one `<unk>` per
audio embedding in 1-s groups between `<|audio_start|>` and `<|audio_end|>`; the embeddings (k,
llm_dim); and the k positions in the ids that they replace. Mode "read" is the reference's
voice-cloning `chat()` recipe: its system turn "Clone the voice in the provided audio prompt.\\n<audio>"
and the encoder with 1-s chunk-causal attention. Mode "reply" is its streaming audio-assistant
recipe: "Clone the voice ...<audio>As an assistant, you will speak using this voice style." and full
attention. The voice then reaches the TTS only through the LLM's hidden state at `<|spk|>`, like
every speaker vector. The encoder is built by `load_voice_encoder` when a voice is first used.

Turns are kept in a bounded least-recently-used cache keyed by the voice's content hash and the mode,
so a voice used request after request (a server's saved voices, `--voice` over the lines of
`say --lines`) is encoded once per mode; `clear()` forgets them (bench, to time a new voice).

This module knows tokens, features and the encoder, not the backends: an LLM stage takes a turn
through `forward(ids, embeds, embed_at)`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .checkpoint import Checkpoint, load_module
from ..errors import CheckpointError, UsageError
from .features import FeatureConfig, log_mel, mel_filters
from ..models.audio_encoder import FRAMES_PER_SECOND, AudioEncoder, AudioEncoderConfig, chunk_mask
from .text import Tokenizers, audio_placeholder, voice_assistant_turn, voice_clone_turn
from ..voices.reference import Voice

AUDIO_PREFIXES = ("apm.", "audio_projection_layer.")
MODES = ("read", "reply")
# Turns kept (a voice has one per mode). A turn holds (k, llm_dim) embeddings, k <= 750: at most
# 5.4 MB each for the 7B in bfloat16, so 32 cost at most ~170 MB of device memory.
CACHED_TURNS = 32


@dataclass(frozen=True)
class VoiceTurn:
    ids: list[int]
    embeds: Tensor  # (k, llm_dim) on the encoder's device
    embed_at: list[int]  # the k positions in `ids` whose input embeddings they replace


class VoiceEncoder:
    """Voices -> LLM input embeddings and the turns that carry them. Not thread-safe."""

    def __init__(self, model: AudioEncoder, tok: Tokenizers, features: FeatureConfig = FeatureConfig()):
        self.model, self.tok, self.features = model.eval(), tok, features
        self.config = model.config
        weight = model.apm.conv1.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.filters = mel_filters(features, self.device)
        self._turns: OrderedDict[tuple[str, str], VoiceTurn] = OrderedDict()
        self.capacity = CACHED_TURNS

    @torch.inference_mode()
    def log_mel(self, voice: Voice) -> Tensor:
        """(n_mels, ceil(n / hop)) float32 features on the encoder's device."""
        samples = torch.tensor(voice.samples, device=self.device)  # (a copy: the voice's array is read-only)
        return log_mel(samples, self.features, self.filters)

    def mask(self, frames: int, chunked: bool) -> Tensor | None:
        """chat()'s chunk-causal mask over the encoder frames, or None (full attention). Given as an
        additive bias in the encoder's dtype (0 or -inf): the same attention as the boolean mask, but
        on CUDA scaled_dot_product_attention keeps its fused kernel for it (a 10-s reference's
        encoding took 18.7 ms with the boolean mask, 7.1 with this one, on an H100)."""
        if not chunked:
            return None
        return chunk_mask(frames, self.config.chunk_frames, self.dtype, self.device)

    @torch.inference_mode()
    def encode(self, voice: Voice, chunked: bool) -> Tensor:
        """(k, llm_dim) embeddings, one per `pool` encoder frames (1/25 s): features, the encoder, the
        projection and pooling, every time (`turn` is what caches)."""
        features = self.log_mel(voice)[None].to(self.dtype)  # (1, n_mels, T)
        frames = (features.shape[-1] - 1) // 2 + 1  # after conv2's stride
        return self.model(features, self.mask(frames, chunked))[0]

    def groups(self, k: int) -> list[int]:
        """Placeholders per 1-s group: the reference's processor writes 25 <unk> a second."""
        per_second = FRAMES_PER_SECOND // self.config.pool
        return [min(per_second, k - i) for i in range(0, k, per_second)]

    def turn(self, voice: Voice, mode: str) -> VoiceTurn:
        """The turn carrying `voice` in `mode` ("read" or "reply"), from the cache when it holds it."""
        if mode not in MODES:
            raise ValueError(f"unknown voice mode {mode!r} ({', '.join(MODES)})")
        key = (voice.digest, mode)
        if key in self._turns:
            self._turns.move_to_end(key)
            return self._turns[key]
        turn = self._make_turn(voice, mode)
        self._turns[key] = turn
        while len(self._turns) > self.capacity:
            self._turns.popitem(last=False)
        return turn

    def cached(self, voice: Voice, mode: str) -> bool:
        return (voice.digest, mode) in self._turns

    def clear(self) -> None:
        self._turns.clear()

    def _make_turn(self, voice: Voice, mode: str) -> VoiceTurn:
        embeds = self.encode(voice, chunked=mode == "read")
        placeholder = audio_placeholder(self.groups(len(embeds)))
        text = voice_clone_turn(placeholder) if mode == "read" else voice_assistant_turn(placeholder)
        ids = self.tok.encode_llm(text)
        slot = self.tok.audio_slot_id
        at = [i for i, t in enumerate(ids) if t == slot]
        if len(at) != len(embeds):
            raise CheckpointError(f"the LLM tokenizer turns {len(embeds)} audio placeholders into {len(at)} tokens")
        return VoiceTurn(ids, embeds, at)


def require_encoder(ckpt: Checkpoint | Path) -> None:
    """A UsageError where the checkpoint (or its directory) has no audio encoder to clone voices with."""
    if isinstance(ckpt, Path):
        ckpt = Checkpoint(ckpt)
    if not ckpt.keys("apm."):
        raise UsageError(f"{ckpt.root} has no audio encoder (apm.* tensors): voice cloning needs a "
                         "MiniCPM-o checkpoint that has one, such as openbmb/MiniCPM-o-2_6")


def load_voice_encoder(ckpt: Checkpoint, config: dict, tok: Tokenizers, *, device, dtype,
                       features: FeatureConfig = FeatureConfig()) -> VoiceEncoder:
    """The audio encoder from the checkpoint's `apm.*` and `audio_projection_layer.*` tensors."""
    require_encoder(ckpt)
    with torch.device("meta"):
        model = AudioEncoder(AudioEncoderConfig.from_hf(config))
    if model.config.n_mels != features.n_mels:
        raise CheckpointError(f"the audio encoder takes {model.config.n_mels} mel bins, the feature "
                              f"extractor makes {features.n_mels}")
    load_module(model, ckpt, "", dtype, device)
    return VoiceEncoder(model, tok, features)
