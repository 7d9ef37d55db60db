"""The codec stage: audio codes (T, num_vq) -> 24 kHz float32 waveform, 512 samples per code frame.

`Codec.decode` is the reference's one-call path (DVAE -> Vocos, no stitching), used for read-aloud.
`StreamDecoder` is its streaming path (spec §4.5 steps 4 and 7): each chunk of new frames is decoded
together with the last 4 frames before it as left context, and the audio of those context frames is
crossfaded with the tail of the previous chunk. It knows nothing about the LLM, the TTS head or text:
callers hand it frames and get samples back.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..models.dvae import DVAEConfig, DVAEDecoder
from ..models.vocos import Vocos, VocosConfig


def _decoding_only(dvae_sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Drops what only encoding (mel -> codes) uses: the encoder side and the FSQ input projections."""
    encoding = ("encoder.", "downsample_conv.")
    return {k: v for k, v in dvae_sd.items() if not k.startswith(encoding) and ".project_in." not in k}


class Codec:
    """DVAE decoder + Vocos. Vocos always runs in float32 (as in the reference, whose benchmark runs
    the DVAE in bf16 but Vocos in float32); the DVAE in whatever dtype it was given."""

    def __init__(self, dvae: DVAEDecoder, vocos: Vocos):
        self.dvae, self.vocos = dvae.eval(), vocos.eval().float()
        self.num_vq = dvae.config.num_vq
        self.samples_per_frame = dvae.config.groups * vocos.config.hop  # 2 mel frames x hop 256

    @classmethod
    def from_tensors(cls, dvae_sd: dict[str, Tensor], vocos_sd: dict[str, Tensor], device) -> "Codec":
        """Both halves in float32 on `device`. `dvae_sd` is `tts.dvae.*` without the prefix; `vocos_sd`
        is `assets/Vocos.pt` as stored. Tensors that decoding does not use are ignored."""
        dvae = DVAEDecoder(DVAEConfig.from_state_dict(dvae_sd))
        vocos = Vocos(VocosConfig.from_state_dict(vocos_sd))
        # strict: a missing, unknown or misshapen tensor raises RuntimeError
        dvae.load_state_dict(_decoding_only(dvae_sd), strict=True)
        vocos.load_state_dict({k: v for k, v in vocos_sd.items() if not k.startswith("feature_extractor.")})
        return cls(dvae.to(device, torch.float32), vocos.to(device, torch.float32))

    @property
    def device(self) -> torch.device:
        return self.dvae.coef.device

    @torch.inference_mode()
    def mel(self, codes: Tensor) -> Tensor:
        """codes (T, num_vq) -> log-mel (n_mels, 2T)."""
        return self.dvae(codes.to(self.device)[None])[0]

    @torch.inference_mode()
    def decode(self, codes: Tensor) -> Tensor:
        """codes (T, num_vq) -> float32 audio (samples_per_frame * T,) on the codec's device."""
        if len(codes) == 0:
            return torch.zeros(0, device=self.device)
        return self.vocos(self.mel(codes)[None].float())[0]

    @torch.inference_mode()
    def decode_batch(self, codes: Tensor) -> Tensor:
        """codes (B, T, num_vq), T > 0 -> float32 audio (B, samples_per_frame * T): each row as `decode`
        gives it up to the rounding of batched convolutions (exact on the CPU without oneDNN)."""
        return self.vocos(self.dvae(codes.to(self.device)).float())


def crossfade(fade_out: Tensor, fade_in: Tensor) -> Tensor:
    """The reference's overlap-add of two equal-length pieces: sample i is weighted (L-i)/(L+1) and
    (i+1)/(L+1), so neither side ever gets weight exactly 1 or 0 (the goldens pin this)."""
    n = fade_out.shape[-1]
    w = torch.arange(1, n + 1, device=fade_in.device, dtype=fade_in.dtype) / (n + 1)
    return fade_out * w.flip(0) + fade_in * w


class StreamDecoder:
    """Decodes frames as they are generated and stitches the chunks as the reference does.

    `feed(frames)` decodes the new frames with up to `context_frames` earlier frames of the same
    segment as left context, crossfades the context's audio with the held tail of the previous chunk,
    and returns the samples that no later chunk can change. `flush()` returns the held remainder
    unsmoothed. Over a segment the emitted audio totals `samples_per_frame` per fed frame.

    `hold_first=True` reproduces the reference's yields exactly: the whole first chunk of a segment is
    held until the next chunk arrives, and each later call returns as many samples as were held (fewer
    only after a chunk of under `context_frames` frames, which would leave the next crossfade short of
    audio; the reference never feeds one, as each of its generate calls makes at least 10 frames).
    `hold_first=False` returns everything except the tail the next chunk will crossfade: the
    concatenated audio is identical, it only comes out earlier.

    `reset(context)` starts a new segment (spec §4.5 step 7): nothing is held, there is no crossfade
    with the previous segment, and the last frames of `context` (frames already heard, e.g. carried
    over by a continuation) are decoded again as left context of the first chunk, so their audio
    (2048 samples) is heard twice, as in the reference.
    """

    CONTEXT_FRAMES = 4  # the reference's left context of a chunk

    def __init__(self, codec: Codec, *, hold_first: bool = True, context_frames: int = CONTEXT_FRAMES):
        self.codec, self.hold_first, self.context_frames = codec, hold_first, context_frames
        self.reset()

    def reset(self, context: Tensor | None = None) -> None:
        """Start a segment, optionally with left context (n, num_vq). Unflushed audio is dropped."""
        empty = torch.zeros(0, self.codec.num_vq, dtype=torch.long, device=self.codec.device)
        self._context = empty if context is None else self._last(self._codes(context))
        self._held = torch.zeros(0, device=self.codec.device)  # decoded audio not yet returned

    def _codes(self, codes: Tensor) -> Tensor:
        return codes.to(self.codec.device, torch.long)

    def _last(self, codes: Tensor) -> Tensor:
        return codes[max(len(codes) - self.context_frames, 0):]

    def feed(self, codes: Tensor) -> Tensor | None:
        """New frames (k, num_vq) -> audio ready to play (1-D float32), or None while it is held back."""
        if len(codes) == 0:
            return None
        spf = self.codec.samples_per_frame
        window = torch.cat([self._context, self._codes(codes)])
        wav = self.codec.decode(window)
        overlap = len(self._context) * spf if len(self._held) else 0  # no crossfade at a segment start
        if overlap:
            head = crossfade(self._held[-overlap:], wav[:overlap])
            wav = torch.cat([self._held[:-overlap], head, wav[overlap:]])
        self._context = self._last(window)
        ready = len(wav) - len(self._context) * spf  # the next chunk crossfades the rest
        if self.hold_first:
            ready = min(ready, len(self._held))
        out, self._held = wav[:ready], wav[ready:]
        return out if len(out) else None

    def flush(self) -> Tensor:
        """End of the segment: the held audio, without smoothing (possibly empty). Resets the decoder."""
        out = self._held
        self.reset()
        return out
