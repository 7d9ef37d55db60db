"""The request bodies of the speech API, as OpenAI's schema: pydantic models, field by field.

Contract: lenient on fields we do not know (OpenAI clients send their own), strict on the values of
those we do (`seed`, `greedy`, `first_chunk`, `max_tokens` are not coerced from strings). `speed` is
OpenAI's (0.25-4), taken by the reply endpoint too. Checks that
need the served model (its formats, limits, voices) are the routes'; these models know only shapes.
The speech socket's messages (`StreamStart`, `StreamText`) are ours, and strict on fields too.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .. import protocol


class VoiceRef(BaseModel):
    """`voice: {"id": NAME}`, OpenAI's object form of a voice name."""

    id: str


class AudioOptions(BaseModel):
    """What speech and reply requests and the speech socket's start share: the voice, the format, our
    extensions (all but the text)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    voice: str | VoiceRef = protocol.DEFAULT_VOICE
    response_format: str = "wav"
    stream_format: str | None = None
    speed: float = 1.0
    # extensions
    seed: int | None = Field(default=None, strict=True)
    greedy: bool = Field(default=False, strict=True)
    first_chunk: int | None = Field(default=None, strict=True)
    voice_samples: str | None = None  # base64 of float32 little-endian 16 kHz mono samples
    timestamps: bool = Field(default=False, strict=True)  # the cues (captions.py): events, or JSON

    @property
    def voice_name(self) -> str:
        return self.voice if isinstance(self.voice, str) else self.voice.id


class AudioRequest(AudioOptions):
    """A speech or reply request: the options and the text."""

    input: str


class SpeechRequest(AudioRequest):
    """`POST /v1/audio/speech`."""

    instructions: str | None = None


class ReplyRequest(AudioRequest):
    """`POST /v1/audio/reply`."""

    max_tokens: int = Field(default=512, strict=True)
    temperature: float = 0.7


class StreamStart(AudioOptions):
    """The first message on the speech socket (`/v1/audio/speech/stream`): `{"type": "start", ...}`
    with the speech request's fields but `input` (the text comes in later messages). Strict: the
    protocol is ours, so an unknown field is an error, not ignored. `stream_format` is `"audio"` by
    default (each generation call decoded as it comes, as `say -o -`); an explicit null decodes each
    segment in one call, as the speech endpoint without `stream_format` (`say -o FILE`)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["start"]
    stream_format: str | None = "audio"


class StreamText(BaseModel):
    """A later message on the speech socket: `text` (more text), `flush` (speak all that is pending
    now) or `end` (the input ended); `flush` and `end` may carry the last text with them."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "flush", "end"]
    text: str = ""
