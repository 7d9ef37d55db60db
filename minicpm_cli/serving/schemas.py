"""The request bodies of the speech API, as OpenAI's schema: pydantic models, field by field.

Contract: lenient on fields we do not know (OpenAI clients send their own), strict on the values of
those we do (`seed`, `greedy`, `first_chunk`, `max_tokens` are not coerced from strings). `speed` is
OpenAI's (0.25-4), taken by the reply endpoint too. Checks that
need the served model (its formats, limits, voices) are the routes'; these models know only shapes.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .. import protocol


class VoiceRef(BaseModel):
    """`voice: {"id": NAME}`, OpenAI's object form of a voice name."""

    id: str


class AudioRequest(BaseModel):
    """What speech and reply requests share: the text, the voice, the format, our extensions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str
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


class SpeechRequest(AudioRequest):
    """`POST /v1/audio/speech`."""

    instructions: str | None = None


class ReplyRequest(AudioRequest):
    """`POST /v1/audio/reply`."""

    max_tokens: int = Field(default=512, strict=True)
    temperature: float = 0.7
