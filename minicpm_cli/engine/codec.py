"""The codec stage: audio codes (T, num_vq) -> 24 kHz float32 waveform, 512 samples per code frame.

`Codec.decode` is the reference's one-call path (DVAE -> Vocos, no stitching), used for read-aloud.
`StreamDecoder` is its streaming path (spec §4.5 steps 4 and 7): each chunk of new frames is decoded
together with the last 4 frames before it as left context, and the audio of those context frames is
crossfaded with the tail of the previous chunk. It knows nothing about the LLM, the TTS head or text:
callers hand it frames and get samples back.

Speed (tempo without a change of pitch) is a resampling of the mel frames in time between the DVAE
and Vocos (`stretch`): each output frame is a linear mix of the two input frames around its source
position, so every frame's spectrum, pitch and formants included, is kept and only the frame rate
changes. The positions are on one grid per segment (output frame j comes from input mel frame
j * speed), so a chunk decoded with its left context yields exactly the output frames of its span and
streamed chunks meet where a one-call decode would have them. Speed 1 takes the plain path: `decode`,
untouched, whatever a backend made of it (compile's CUDA graphs); another speed runs the codec's
eager halves (`mel`, then Vocos) with the resampling between them.
"""

from __future__ import annotations

import functools
import math

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
        self.hop = vocos.config.hop  # samples per mel frame
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

    @torch.inference_mode()
    def decode_at(self, codes: Tensor, speed: float, begin: int = 0) -> Tensor:
        """codes (T, num_vq), frames [begin, begin + T) of a segment -> float32 audio at `speed`, the
        samples of that span on the segment's stretched grid (`samples_at(begin + T) - samples_at(begin)`).
        Speed 1 is `decode` itself."""
        if speed == 1.0:
            return self.decode(codes)
        groups = self.samples_per_frame // self.hop
        mel = stretch(self.mel(codes), speed, begin * groups) if len(codes) else None
        if mel is None or mel.shape[-1] == 0:
            return torch.zeros(0, device=self.device)
        return self.vocos(mel[None].float())[0]


def stretched_frames(frames: int, speed: float) -> int:
    """How many frames of a mel stretched by `speed` come from its first `frames` frames: the output
    frames j whose source position j * speed lies before `frames`."""
    if speed == 1.0:
        return frames
    # (the tolerance keeps an exact multiple, e.g. 6 / 1.5, from rounding up to one frame more)
    return max(math.ceil(frames / speed - 1e-9), 0)


def samples_at(codec, frames: int, speed: float) -> int:
    """The samples of a segment's first `frames` code frames at `speed` (`codec`: a Codec or a lane
    of one): `samples_per_frame` each at speed 1, else the stretched mel frames' hops."""
    if speed == 1.0:
        return frames * codec.samples_per_frame
    return stretched_frames(frames * (codec.samples_per_frame // codec.hop), speed) * codec.hop


def stretch(mel: Tensor, speed: float, begin: int = 0) -> Tensor:
    """mel (..., F), frames [begin, begin + F) of a segment -> the frames of the segment's mel played
    at `speed` whose source positions fall in that span: output frame j (from stretched_frames(begin)
    to stretched_frames(begin + F)) is the linear interpolation at input frame j * speed, the span's
    last frame standing for those past it (a chunk's last frames, which the next chunk's left context
    decodes again). Frequencies are untouched: only the frame axis is resampled. Our own gather, not
    F.interpolate, whose grid is relative to each call and so would not line chunks up."""
    n = mel.shape[-1]
    first, stop = stretched_frames(begin, speed), stretched_frames(begin + n, speed)
    pos = (torch.arange(first, stop, device=mel.device, dtype=torch.float64) * speed - begin).clamp(0, n - 1)
    lo = pos.floor().long()
    hi = (lo + 1).clamp(max=n - 1)
    w = (pos - lo).to(mel.dtype)
    return mel[..., lo] * (1 - w) + mel[..., hi] * w


def crossfade(fade_out: Tensor, fade_in: Tensor) -> Tensor:
    """The reference's overlap-add of two equal-length pieces: sample i is weighted (L-i)/(L+1) and
    (i+1)/(L+1), so neither side ever gets weight exactly 1 or 0 (the goldens pin this)."""
    down, up = _fades(fade_out.shape[-1], fade_in.device, fade_in.dtype)
    return fade_out * down + fade_in * up


@functools.lru_cache(maxsize=64)
def _fades(n: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`crossfade`'s weights, made once for each length (three launches a chunk and stream saved)."""
    with torch.inference_mode():
        up = torch.arange(1, n + 1, device=device, dtype=dtype) / (n + 1)
        return up.flip(0), up


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

    `speed` other than 1 decodes each window at that tempo (`Codec.decode_at`) on the segment's
    stretched grid: a window's context frames then stand for the samples they span on that grid (a
    whole number of mel hops, 2048 / speed give or take a hop), and that is the crossfade's length, so
    each chunk still crossfades with exactly the audio it decodes again.

    The audio is stitched on the host: each window's samples come off the device in one copy (which
    the caller needs anyway to play them), and the crossfade and joins of a few thousand samples cost
    no launches there (on a GPU with many streams, five a stream and chunk, one after another, while
    the device waited for the host). Each is an exactly rounded float32 multiply or add, on the host
    as on a GPU.

    `reset(context)` starts a new segment (spec §4.5 step 7): nothing is held, there is no crossfade
    with the previous segment, and the last frames of `context` (frames already heard, e.g. carried
    over by a continuation) are decoded again as left context of the first chunk, so their audio
    (2048 samples) is heard twice, as in the reference.
    """

    CONTEXT_FRAMES = 4  # the reference's left context of a chunk

    def __init__(self, codec: Codec, *, hold_first: bool = True, context_frames: int = CONTEXT_FRAMES,
                 speed: float = 1.0):
        self.codec, self.hold_first, self.context_frames, self.speed = codec, hold_first, context_frames, speed
        self.reset()

    def reset(self, context: Tensor | None = None) -> None:
        """Start a segment, optionally with left context (n, num_vq). Unflushed audio is dropped."""
        empty = torch.zeros(0, self.codec.num_vq, dtype=torch.long, device=self.codec.device)
        self._context = empty if context is None else self._last(self._codes(context))
        self._held = torch.zeros(0)  # decoded audio not yet returned (on the host)
        self._begin = 0  # the next window's first frame in the segment (its context's first)

    def _codes(self, codes: Tensor) -> Tensor:
        return codes.to(self.codec.device, torch.long)

    def _last(self, codes: Tensor) -> Tensor:
        return codes[max(len(codes) - self.context_frames, 0):]

    def _span(self, frames: int) -> int:
        """Samples of the context's `frames` frames, which start the window at `self._begin`."""
        return samples_at(self.codec, self._begin + frames, self.speed) - samples_at(self.codec, self._begin, self.speed)

    def feed(self, codes: Tensor) -> Tensor | None:
        """New frames (k, num_vq) -> audio ready to play (1-D float32), or None while it is held back."""
        if len(codes) == 0:
            return None
        window = torch.cat([self._context, self._codes(codes)])
        # (speed 1: `decode` itself; a batch's lane hands back host audio, one copy for the round's rows)
        wav = self.codec.decode_at(window, self.speed, self._begin).cpu()
        overlap = self._span(len(self._context)) if len(self._held) else 0  # no crossfade at a segment start
        if overlap:
            head = crossfade(self._held[-overlap:], wav[:overlap])
            wav = torch.cat([self._held[:-overlap], head, wav[overlap:]])
        self._context = self._last(window)
        self._begin += len(window) - len(self._context)
        ready = len(wav) - self._span(len(self._context))  # the next chunk crossfades the rest
        if self.hold_first:
            ready = min(ready, len(self._held))
        out, self._held = wav[:ready], wav[ready:]
        return out if len(out) else None

    def flush(self) -> Tensor:
        """End of the segment: the held audio, without smoothing (possibly empty). Resets the decoder."""
        out = self._held
        self.reset()
        return out
