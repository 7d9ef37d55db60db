"""The terms `minicpm serve` and its thin client share: address, environment variables, voices,
audio formats, limits and event names. Plain constants, no imports: the client path (`say` through
a server) must stay free of torch and the model code.
"""

from __future__ import annotations

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8910
DEFAULT_URL = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
SERVER_ENV = "MINICPM_SERVER"  # the server `say`/`reply` look for; empty: never look
API_KEY_ENV = "MINICPM_API_KEY"  # the key `serve` requires and the client sends

DEFAULT_VOICE = "default"
# OpenAI's built-in voice names: a drop-in client sends one of them, and hears the default voice (unless
# a saved voice has that name)
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse")
# OpenAI's own TTS model names, accepted as the served model so that drop-in clients work unchanged
MODEL_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")

# response_format: raw PCM (streamable, no header), WAV (a streaming header, or a whole file), and
# whole encoded files. pcm_f32 is our extension: float32 samples exactly as generated, what the
# thin client asks for so that its sinks write the same bytes as the local path.
RAW_FORMATS = {"pcm": "s16", "pcm_f32": "f32"}
STREAMABLE = ("wav", "pcm", "pcm_f32")
ENCODED = ("flac", "mp3", "opus")  # whole files only (libsndfile patches their headers at the end)
STREAM_FORMATS = ("audio", "sse")

# The speech socket (WebSocket): text in as it comes, audio out as it is made (docs/streaming.md). A
# browser, which cannot set headers, offers the key as the subprotocol `minicpm.key.KEY` beside
# `minicpm`, which the server then selects (a browser fails a handshake that selects none). An error
# closes it with 4000 + the status the same error has over HTTP (4400, 4401, 4413, 4503, ...).
SPEECH_STREAM_PATH = "/v1/audio/speech/stream"
WS_SUBPROTOCOL = "minicpm"
WS_KEY_PREFIX = "minicpm.key."
WS_CLOSE_ERROR = 4000
# A speech socket whose stream has waited this long for text (nothing to speak, its input not ended)
# is closed with 4408: a parked stream holds one of the server's rows (`serve --socket-idle`; 0: no limit)
SOCKET_IDLE_S = 60.0

# Frames (21.3 ms) in a generation call: the range of `first_chunk` (= tts.FRAMES_PER_CALL; a test
# checks they agree, this module cannot import the model code)
FRAMES_PER_CALL = 25

# A request's `input` is at most this many characters (about two hours of speech; OpenAI's limit is
# 4096), its body at most this many bytes (room for the input JSON-escaped) besides `voice_samples`
# (our extension, the thin client's reference voice: base64 float32 16 kHz samples, at most 30 s =
# voice.MAX_SECONDS, which a test checks); a voice upload (POST /v1/voices) at most MAX_UPLOAD_BYTES
# (a 30 s recording in any format: 96 kHz 32-bit stereo WAV is 23 MB). Beyond, 413.
MAX_INPUT_CHARS = 100_000
MAX_BODY_BYTES = 2 << 20
MAX_VOICE_SECONDS = 30
MAX_VOICE_SAMPLES_CHARS = 4 * -(-MAX_VOICE_SECONDS * 16000 * 4 // 3)  # base64 of the float32 samples
MAX_VOICE_BODY_BYTES = MAX_BODY_BYTES + MAX_VOICE_SAMPLES_CHARS
MAX_UPLOAD_BYTES = 32 << 20

# `speed` (OpenAI's field, and --speed): the tempo, from a quarter to four times as fast, the pitch kept
SPEED_RANGE = (0.25, 4.0)

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes (and so `--seed`)



def not_unicode(text: str, where: str) -> str | None:
    """A one-line message if `text` (named `where`) holds a character no UTF-8 can encode, else None:
    an unpaired surrogate (a JSON "\\ud800"), or a byte of non-UTF-8 input that Python kept as
    U+DC80-U+DCFF. The tokenizers refuse such text with a TypeError: every way in (arguments, stdin,
    files, requests) is checked with this."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        at = e.start
    code = ord(text[at])
    if 0xDC80 <= code <= 0xDCFF:
        return f"{where} is not UTF-8: byte 0x{code - 0xDC00:02X} at character {at + 1}"
    return f"{where} is not Unicode text: an unpaired surrogate, U+{code:04X}, at character {at + 1}"
