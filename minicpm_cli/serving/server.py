"""`minicpm serve`: one resident model behind an OpenAI-compatible speech API (FastAPI on uvicorn).

In: a function that loads the model (the command builds it from its options), an address, an
optional API key. Out, over HTTP:

- `POST /v1/audio/speech`: OpenAI's speech request. Without `stream_format` the audio is the whole
  file `minicpm say -o FILE` writes (each segment decoded in one call); with `stream_format: "audio"`
  it is what `say -o -` streams (decoded chunk by chunk, sent as generated); `"sse"` carries the same
  bytes in `speech.audio.delta` events, then `speech.audio.done`. Extensions: `seed`, `greedy`,
  `first_chunk`, the `pcm_f32` format (the samples as generated, what the thin client asks for) and
  `voice_samples` (a reference voice's 16 kHz float32 samples, base64: what the thin client sends).
- `POST /v1/audio/reply`: a spoken answer, as `minicpm reply`: server-sent events `reply.text.delta`,
  `reply.audio.delta`, then `reply.done`.
- `GET /health` (200 once the model is loaded and warm, 503 before), `GET /v1/models`,
  `GET /props` (what is served: model, backend, device, formats, limits), `GET /v1/voices` and
  `GET /v1/audio/voices` (the voices), `POST /v1/voices` (save one: multipart `name` and `file`).

`voice` names a saved voice (`voice_store`: the same directory `minicpm voice add` writes, read at
each request); `default` is the model's own voice, and OpenAI's names speak it too unless a saved voice
has the name. The voices' encodings are kept by the model's voice encoder (an LRU keyed by the
samples' hash, per read/reply kind), so a saved voice is encoded once.

Errors are OpenAI's error object with their status (400 bad value, 401 key, 403 voice uploads refused,
404 model or path, 409 voice name taken, 413 too large, 422 malformed, 503 loading, 500 our fault, in
one line); the server stays up after any of them.

The model is touched by one thread only (`worker.Worker`): requests queue in arrival order and each
runs its generator there, chunk by chunk, handing chunks to the event loop, which keeps answering
(health checks, new requests) meanwhile. A request whose client goes away is stopped after the chunk
being generated. This module knows nothing of backends: what to load is decided by the command.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import io
import ipaddress
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import soundfile as sf
import uvicorn
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__, protocol
from ..audio import to_pcm, wav_header
from ..errors import MinicpmError, UsageError, VoiceError
from ..voices.reference import Voice
from ..voices.store import VoiceExists, VoiceStore, check_name
from .worker import Job, Worker

# -- what is served ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Loaded:
    """A loaded model and what it is: what `/props` and `/v1/models` say, what clients check."""

    synth: Any  # a pipeline.Synthesizer (or anything with its synthesize/reply/tokenizers/sample_rate)
    model: str  # the id clients name it by: --model as given, or the backend's default repo
    backend: str
    device: str  # "cpu", "cuda:0"
    dtype: str  # "float32", "bfloat16"
    path: str | None = None  # the checkpoint directory, when --model named one
    gguf: str | None = None
    environment: dict = field(default_factory=dict)  # device name, driver, versions (bench records it)
    # random weights (speed work): every request's lengths forced, as `bench --random-weights` forces them
    frames_per_token: int | None = None
    reply_tokens: int | None = None


def load_served(model: Optional[str], backend: str, device: str, dtype: str, gguf: Optional[str],
             random_weights: bool, rows: int = 1):
    """Load what `serve` serves (here, or in a Ray Serve replica), `rows` requests at once: a Loaded."""
    from ..engine import loading

    synth, name, model_id = loading.load(model, backend, device, dtype, gguf, rows=rows, random_weights=random_weights)
    path = Path(model_id).expanduser()
    return Loaded(synth, model="random-weights" if random_weights else model_id, backend=name,
                      device=str(synth.device), dtype=str(synth.tts.dtype).removeprefix("torch."),
                      path=str(path.resolve()) if path.is_dir() and not random_weights else None, gguf=gguf,
                      environment=loading.environment(synth.device),
                      frames_per_token=loading.FORCED_FRAMES_PER_TOKEN if random_weights else None,
                      reply_tokens=loading.FORCED_REPLY_TOKENS if random_weights else None)


@dataclass(frozen=True)
class ServeOptions:
    host: str = protocol.DEFAULT_HOST
    port: int = protocol.DEFAULT_PORT  # 0: any free port (the ready line says which)
    api_key: str | None = None
    verbose: bool = False  # uvicorn's access log and startup lines


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# -- requests, as OpenAI's schema ----------------------------------------------------------------


class VoiceRef(BaseModel):
    id: str


class _AudioRequest(BaseModel):
    # Lenient on fields we do not know (OpenAI clients send their own), strict on values.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str
    voice: str | VoiceRef = protocol.DEFAULT_VOICE
    response_format: str = "wav"
    stream_format: str | None = None
    # extensions
    seed: int | None = Field(default=None, strict=True)
    greedy: bool = Field(default=False, strict=True)
    first_chunk: int | None = Field(default=None, strict=True)
    voice_samples: str | None = None  # base64 of float32 little-endian 16 kHz mono samples


class SpeechRequest(_AudioRequest):
    speed: float = 1.0
    instructions: str | None = None


class ReplyRequest(_AudioRequest):
    max_tokens: int = Field(default=512, strict=True)
    temperature: float = 0.7


class ApiError(Exception):
    """An error response: status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


LOADING = ApiError(503, "the model is loading", code="model_loading", kind="service_unavailable")


# -- audio bytes ---------------------------------------------------------------------------------


FILES = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"),
         "opus": ("OGG", "OPUS")}  # whole files: soundfile's format and subtype
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "pcm_f32": "audio/pcm", "flac": "audio/flac",
               "mp3": "audio/mpeg", "opus": "audio/ogg"}


def writable_formats() -> dict[str, str | None]:
    """Each response format -> None if this libsndfile can write it, else why not."""
    out: dict[str, str | None] = {name: None for name in (*protocol.STREAMABLE, *protocol.ENCODED)}
    for name in protocol.ENCODED:
        try:
            encode(np.zeros(2400, dtype=np.float32), name, 24000)
        except Exception as e:  # (soundfile raises its own types, or TypeError/ValueError)
            out[name] = f"the installed libsndfile ({sf.__libsndfile_version__}) cannot write {name}: {e}"
    return out


def encode(samples: np.ndarray, fmt: str, sample_rate: int) -> bytes:
    """A whole file, as `say -o FILE` writes it (16-bit samples converted as audio.to_pcm does)."""
    kind, subtype = FILES[fmt]
    data = to_pcm(samples, "s16") if subtype == "PCM_16" else np.clip(samples, -1.0, 1.0).astype(np.float32)
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", samplerate=sample_rate, channels=1, format=kind, subtype=subtype) as f:
        f.write(data)
    return buf.getvalue()


def raw(samples: np.ndarray, fmt: str) -> bytes:
    """Streamed samples: s16le for wav and pcm, f32le for pcm_f32 (audio.RawSink's bytes)."""
    pcm = protocol.RAW_FORMATS.get(fmt, "s16")
    return to_pcm(samples, pcm).astype("<i2" if pcm == "s16" else "<f4").tobytes()


def sse(event: dict) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


# -- the model and its state ---------------------------------------------------------------------


class Service:
    """The model and its state: loading, then ready (after a warm-up) or failed."""

    def __init__(self, load: Callable[[], Loaded], warm_up: bool = True, store: VoiceStore | None = None):
        self.loaded: Loaded | None = None
        self.store = store or VoiceStore()
        self.failure: BaseException | None = None
        self.formats = writable_formats()
        self.worker = Worker()
        self._load, self._warm_up = load, warm_up
        self._ready = threading.Event()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def start(self, on_ready: Callable[[Loaded], None], on_failure: Callable[[BaseException], None]) -> None:
        def start() -> None:
            try:
                loaded = self._load()
                engine = loaded.synth.batch() if getattr(loaded.synth, "rows", 1) > 1 else None
                if self._warm_up:
                    warm_up(loaded, engine)
            except BaseException as e:
                self.failure = e
                on_failure(e)
                return
            self.loaded, self.worker.engine = loaded, engine
            self._ready.set()
            on_ready(loaded)

        self.worker.submit(start)

    def props(self) -> dict:
        ld = self.loaded
        return {"model": ld.model, "path": ld.path, "backend": ld.backend, "device": ld.device,
                "dtype": ld.dtype, "gguf": ld.gguf, "sample_rate": ld.synth.sample_rate,
                "voices": self.voice_names(), "version": __version__,
                "response_formats": [f for f, why in self.formats.items() if why is None],
                "limits": {"max_input_chars": protocol.MAX_INPUT_CHARS, "max_body_bytes": protocol.MAX_BODY_BYTES,
                           "max_voice_body_bytes": protocol.MAX_VOICE_BODY_BYTES,
                           "max_upload_bytes": protocol.MAX_UPLOAD_BYTES},
                "extensions": ["voice_samples"],
                "forced_lengths": None if ld.frames_per_token is None else
                {"frames_per_token": ld.frames_per_token, "reply_tokens": ld.reply_tokens},
                "environment": ld.environment}

    def voice_names(self) -> list[str]:
        return [protocol.DEFAULT_VOICE, *self.store.names()]

    async def voice(self, req: "_AudioRequest") -> Voice | None:
        """The voice a request asks for (None: the model's own), or a 400 that lists the voices."""
        name = req.voice if isinstance(req.voice, str) else req.voice.id
        if req.voice_samples is not None:
            if name != protocol.DEFAULT_VOICE:
                raise ApiError(400, f"give voice '{name}' or voice_samples, not both", param="voice_samples")
            return await asyncio.to_thread(_decode_samples, req.voice_samples)
        if name == protocol.DEFAULT_VOICE:
            return None
        try:
            if self.store.has(name):
                return await asyncio.to_thread(self.store.load, name)
        except VoiceError as e:
            raise ApiError(400, " ".join(str(e).split()), param="voice") from None
        if name in protocol.OPENAI_VOICES:
            return None
        raise ApiError(400, f"unknown voice '{name}' (voices: {', '.join(self.voice_names())}; OpenAI's names "
                            "speak the default voice unless a saved voice has the name)", param="voice")

    async def run(self, request: Request, work: Callable[[], Iterable]) -> tuple[Job, Callable[[], None]]:
        """Queue `work` (a function returning the request's chunks); returns the job and a function
        that ends it. The job is cancelled as soon as the client disconnects, queued or running."""
        job = Job(work, asyncio.get_running_loop())
        watcher = asyncio.create_task(_watch(request, job))

        def end() -> None:
            job.cancel()
            watcher.cancel()

        self.worker.submit_job(job)
        return job, end


async def _watch(request: Request, job: Job) -> None:
    # (the body has been read: the next message is the disconnect, or the end of the response)
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


def warm_up(ld: Loaded, engine=None) -> None:
    """One short request down each path (read streamed and per segment, a reply), so that the first
    real request does not pay for compilation or first-use costs; with a batch `engine`, as many of
    them at once as it has rows (and one alone), so its batched steps are ready too."""
    from ..engine.batching import Stream
    from ..engine.llm import LLMSampling
    from ..engine.sampling import Sampling

    forced = ld.frames_per_token
    works = [lambda lane, d=d: ld.synth.synthesize("Hello.", Sampling(greedy=True), decode=d, frames_per_token=forced,
                                                   lane=lane) for d in ("stream", "segment")]
    works.append(lambda lane: ld.synth.reply("Hi.", Sampling(greedy=True), llm=LLMSampling(),
                                             max_tokens=ld.reply_tokens or 4, frames_per_token=forced, lane=lane))
    for work in works:
        for _ in work(None):
            pass
    if engine is not None:
        failed = []
        for k in range(engine.rows):
            engine.submit(Stream(works[k % len(works)], lambda item: None,
                                 lambda error: error is not None and failed.append(error)))
        engine.run()
        if failed:
            raise failed[0]


# -- the application -----------------------------------------------------------------------------


def create_app(service: Service, api_key: str | None = None, voice_uploads: bool = True) -> FastAPI:
    """The application. `voice_uploads`: whether POST /v1/voices may save voices (`run` allows it with
    an API key or on a loopback address only)."""
    app = FastAPI(title="minicpm", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    started = time.time()

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            return ApiError(422, f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'invalid')})",
                            code="invalid_json").response()
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return ApiError(422, " ".join(message.split()), param=where or None, code="invalid_request").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        message = f"{request.method} {request.url.path}: {e.detail}"
        return ApiError(e.status_code, message, code=code).response()

    def loaded() -> Loaded:
        if not service.ready:
            raise LOADING
        return service.loaded

    @app.get("/health")
    async def health():
        loaded()
        return {"status": "ok"}

    @app.get("/props")
    async def props():
        loaded()
        return service.props()

    @app.get("/v1/models")
    async def models():
        ld = loaded()
        return {"object": "list", "data": [{"id": ld.model, "object": "model", "created": int(started),
                                            "owned_by": "minicpm"}]}

    @app.get("/v1/audio/voices")
    async def audio_voices():
        loaded()
        return {"voices": service.voice_names()}

    @app.get("/v1/voices")
    async def voices():
        loaded()
        saved = await asyncio.to_thread(_saved_voices, service.store)
        shadowed = {v["id"] for v in saved}
        default = {"id": protocol.DEFAULT_VOICE, "object": "voice", "kind": "builtin",
                   "aliases": [n for n in protocol.OPENAI_VOICES if n not in shadowed]}
        return {"object": "list", "data": [default, *saved]}

    @app.post("/v1/voices")
    async def add_voice(name: str = Form(...), file: UploadFile = File(...), force: bool = Form(False)):
        loaded()
        if not voice_uploads:
            raise ApiError(403, "this server takes no voices over HTTP: one reachable from other machines needs "
                                "--api-key to accept them", code="voice_uploads_disabled")
        try:
            check_name(name)
        except UsageError as e:
            raise ApiError(400, " ".join(str(e).split()), param="name") from None
        data, source = await file.read(), file.filename or "upload"
        try:
            saved = await asyncio.to_thread(service.store.add, name, io.BytesIO(data), force=force, source_name=source)
        except VoiceExists:
            raise ApiError(409, f"a voice named '{name}' is saved already (force=true replaces it)", param="name",
                           code="voice_exists") from None
        except VoiceError as e:
            raise ApiError(400, " ".join(str(e).split()), param="file") from None
        return _voice_object(saved)

    @app.post("/v1/audio/speech")
    async def speech(req: SpeechRequest, request: Request):
        t0 = time.perf_counter()
        ld = loaded()
        fmt = _check_common(req, ld, service, request)
        if req.speed != 1.0:
            raise ApiError(400, f"speed {req.speed} is not supported: only 1.0", param="speed")
        if req.instructions:
            raise ApiError(400, "instructions are not supported (one voice, read as written)", param="instructions")
        if req.stream_format is not None and req.stream_format not in protocol.STREAM_FORMATS:
            raise ApiError(400, f"unknown stream_format '{req.stream_format}' (audio or sse)", param="stream_format")
        if req.stream_format is not None and fmt not in protocol.STREAMABLE:
            raise ApiError(400, f"{fmt} comes as a whole file: leave stream_format out, or stream "
                                f"{', '.join(protocol.STREAMABLE)}", param="stream_format")
        voice = await service.voice(req)
        synth, sampling, frames = ld.synth, _sampling(req), _first_chunk(req)
        decode = "segment" if req.stream_format is None else "stream"
        usage = {"input_tokens": 0, "output_tokens": 0}

        def work(lane):
            usage["input_tokens"] = len(synth.tokenizers.encode_bert(req.input.strip()))
            return synth.synthesize(req.input, sampling, decode=decode, first_chunk=frames,
                                    frames_per_token=ld.frames_per_token, voice=voice, lane=lane)

        job, end = await service.run(request, work)
        first = await first_block(job, end)
        # the server's own time to first audio (the worker's queue and hop included), for clients that
        # measure theirs (tools/serve_latency.py)
        timing = {"Server-Timing": f"first-chunk;dur={(time.perf_counter() - t0) * 1e3:.1f}"}
        rate = synth.sample_rate
        if req.stream_format is None and fmt not in protocol.RAW_FORMATS:  # a whole file
            try:
                chunks = [c async for c in _rest(job, first)]
            finally:
                end()
            samples = np.concatenate([c.samples for c in chunks]) if chunks else np.zeros(0, np.float32)
            data = await asyncio.to_thread(encode, samples, fmt, rate)
            return Response(data, media_type=MEDIA_TYPES[fmt], headers=timing)

        def pieces(chunk) -> bytes:
            usage["output_tokens"] += len(chunk.codes)  # audio frames
            return raw(chunk.samples, fmt) if len(chunk.samples) else b""

        head = wav_header(rate, "s16") if fmt == "wav" else b""
        if req.stream_format == "sse":
            async def events():
                try:
                    if head:
                        yield sse({"type": "speech.audio.delta", "audio": _b64(head)})
                    async for chunk in _rest(job, first):
                        if data := pieces(chunk):
                            yield sse({"type": "speech.audio.delta", "audio": _b64(data)})
                    total = usage["input_tokens"] + usage["output_tokens"]
                    yield sse({"type": "speech.audio.done", "usage": {**usage, "total_tokens": total}})
                except Exception as e:
                    yield sse({"type": "error", **_internal_error(e).body()})
                finally:
                    end()

            return _event_stream(events(), timing)

        async def body():
            try:
                if head:
                    yield head
                async for chunk in _rest(job, first):
                    if data := pieces(chunk):
                        yield data
            except Exception as e:
                _internal_error(e)
                raise _Aborted from None
            finally:
                end()

        return StreamingResponse(body(), media_type=MEDIA_TYPES[fmt], headers=timing)

    @app.post("/v1/audio/reply")
    async def reply(req: ReplyRequest, request: Request):
        ld = loaded()
        fmt = _check_common(req, ld, service, request)
        if req.stream_format not in (None, "sse"):
            raise ApiError(400, "the reply endpoint streams server-sent events: stream_format is sse",
                           param="stream_format")
        if fmt not in protocol.STREAMABLE:
            raise ApiError(400, f"a reply is streamed: response_format is one of {', '.join(protocol.STREAMABLE)}",
                           param="response_format")
        if not req.temperature > 0:
            raise ApiError(400, "temperature must be positive (use greedy for the most likely tokens)",
                           param="temperature")
        if req.max_tokens < 1:
            raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
        from ..engine.llm import LLMSampling

        voice = await service.voice(req)
        synth, sampling, frames = ld.synth, _sampling(req), _first_chunk(req)
        llm = LLMSampling(temperature=req.temperature)

        def work(lane):
            return synth.reply(req.input, sampling, llm=llm, max_tokens=ld.reply_tokens or req.max_tokens,
                               first_chunk=frames, frames_per_token=ld.frames_per_token, voice=voice, lane=lane)

        job, end = await service.run(request, work)
        first = await first_block(job, end)
        head = wav_header(synth.sample_rate, "s16") if fmt == "wav" else b""

        async def events():
            said, frames_out = [], 0
            try:
                if head:
                    yield sse({"type": "reply.audio.delta", "audio": _b64(head)})
                async for chunk in _rest(job, first):
                    frames_out += len(chunk.codes)
                    if len(chunk.samples):
                        yield sse({"type": "reply.audio.delta", "audio": _b64(raw(chunk.samples, fmt))})
                    if chunk.text:
                        said.append(chunk.text)
                        yield sse({"type": "reply.text.delta", "text": chunk.text})
                yield sse({"type": "reply.done", "text": "".join(said), "usage": {"output_tokens": frames_out}})
            except Exception as e:
                yield sse({"type": "error", **_internal_error(e).body()})
            finally:
                end()

        return _event_stream(events())

    # (the last added runs first: errors guarded, then the key checked, then the body read)
    app.add_middleware(_BodyLimit, limit=protocol.MAX_BODY_BYTES, larger=BODY_LIMITS)
    app.add_middleware(_Auth, api_key=api_key)
    app.add_middleware(_Guard)
    return app


def _check_common(req: _AudioRequest, ld: Loaded, service: Service, request: Request) -> str:
    """Checks shared by speech and reply (the voice apart); returns the response format."""
    size = request.scope.get(BODY_SIZE, 0) - len(req.voice_samples or "")
    if size > protocol.MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {protocol.MAX_BODY_BYTES} bytes (voice_samples apart)",
                       code="request_too_large")
    if req.model is not None and req.model not in (ld.model, *protocol.MODEL_ALIASES):
        raise ApiError(404, f"the model '{req.model}' is not served here (this server serves '{ld.model}')",
                       param="model", code="model_not_found")
    if len(req.input) > protocol.MAX_INPUT_CHARS:
        raise ApiError(413, f"the input has {len(req.input)} characters, more than the "
                            f"{protocol.MAX_INPUT_CHARS} a request takes", param="input", code="input_too_long")
    fmt = req.response_format
    if fmt not in service.formats:
        known = ", ".join(f for f, why in service.formats.items() if why is None)
        raise ApiError(400, f"response_format '{fmt}' is not supported (use one of {known})", param="response_format")
    if service.formats[fmt] is not None:
        raise ApiError(400, service.formats[fmt], param="response_format")
    if req.greedy and req.seed is not None:
        raise ApiError(400, "greedy takes no seed: greedy decoding draws nothing (give one or the other)",
                       param="seed")
    if req.seed is not None and not protocol.SEED_RANGE[0] <= req.seed <= protocol.SEED_RANGE[1]:
        raise ApiError(400, f"seed must be between {protocol.SEED_RANGE[0]} and {protocol.SEED_RANGE[1]}",
                       param="seed")
    if req.first_chunk is not None and not 1 <= req.first_chunk <= protocol.FRAMES_PER_CALL:
        raise ApiError(400, f"first_chunk must be between 1 and {protocol.FRAMES_PER_CALL} frames",
                       param="first_chunk")
    return fmt


def _decode_samples(text: str) -> Voice:
    """`voice_samples`: base64 of float32 little-endian 16 kHz mono samples, checked as any reference."""
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "voice_samples is not base64", param="voice_samples") from None
    if len(data) % 4:
        raise ApiError(400, "voice_samples is not whole float32 samples (4 bytes each)", param="voice_samples")
    try:
        return Voice(np.frombuffer(data, dtype="<f4"), name="voice_samples")
    except VoiceError as e:
        raise ApiError(400, " ".join(str(e).split()), param="voice_samples") from None


def _voice_object(v) -> dict:
    """A saved voice (voice_store.SavedVoice) as the voice endpoints show it."""
    return {"id": v.name, "object": "voice", "kind": "saved", "seconds": round(v.seconds, 3),
            "created": int(v.added.timestamp()) if v.added else None, "source": v.source or None}


def _saved_voices(store: VoiceStore) -> list[dict]:
    out = []
    for name in store.names():
        try:
            out.append(_voice_object(store.get(name)))
        except VoiceError:  # (removed meanwhile, or unreadable: not a voice to offer)
            pass
    return out


def _sampling(req: _AudioRequest):
    from ..engine.sampling import Sampling

    return Sampling(greedy=req.greedy, seed=req.seed)


def _first_chunk(req: _AudioRequest) -> int:
    return protocol.FRAMES_PER_CALL if req.first_chunk is None else req.first_chunk


async def first_block(job: Job, end: Callable[[], None]):
    """The first chunk, before the response starts: a request that fails at once (no readable text)
    gets its error status rather than a 200 and a broken stream."""
    try:
        return await job.next()
    except StopAsyncIteration:
        end()
        return None
    except UsageError as e:
        end()
        raise ApiError(400, " ".join(str(e).split())) from None
    except BaseException:
        end()
        raise


async def _rest(job: Job, first) -> AsyncIterator:
    if first is None:
        return
    yield first
    while True:
        try:
            yield await job.next()
        except StopAsyncIteration:
            return


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _event_stream(events: AsyncIterator[bytes], headers: dict | None = None) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})


def _internal_error(e: BaseException) -> ApiError:
    """A failure of ours: one line on the server's stderr (the traceback with MINICPM_DEBUG=1) and a
    500 whose message names it."""
    if isinstance(e, UsageError):
        return ApiError(400, " ".join(str(e).split()))
    message = " ".join(f"{type(e).__name__}: {e}".split()) if not isinstance(e, MinicpmError) else " ".join(str(e).split())
    if os.environ.get("MINICPM_DEBUG"):
        import traceback

        traceback.print_exception(e, file=sys.stderr)
    print(f"minicpm: error in a request: {message}", file=sys.stderr, flush=True)
    return ApiError(500, message, kind="server_error", code="internal_error")


class _Aborted(Exception):
    """A streamed response that failed after it started: its connection is dropped, so the client
    sees the body end before its end (said once on stderr, by `_internal_error`)."""


# -- middleware (plain ASGI) ----------------------------------------------------------------------


async def _send_error(send, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _Guard:
    """The last line: an exception no handler took becomes a 500 in OpenAI's shape (and one line on
    stderr, never a traceback), or, once the response has started, a dropped connection."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        started = False

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except _Aborted:
            pass  # (uvicorn closes the connection: the chunked body never gets its last chunk)
        except Exception as e:
            error = _internal_error(e)
            if not started:
                await _send_error(send, error)


# Paths whose bodies may be larger than MAX_BODY_BYTES: requests that may carry voice_samples (whose
# other fields `_check_common` holds to MAX_BODY_BYTES, knowing the size from BODY_SIZE) and uploads.
BODY_LIMITS = {"/v1/audio/speech": protocol.MAX_VOICE_BODY_BYTES, "/v1/audio/reply": protocol.MAX_VOICE_BODY_BYTES,
               "/v1/voices": protocol.MAX_UPLOAD_BYTES}
BODY_SIZE = "minicpm.body_bytes"  # the request's scope key for its body's size


class _BodyLimit:
    """Reads the whole request body first, answering 413 as soon as it passes `limit` bytes (the
    path's own limit in `larger`); the size is left in the scope under BODY_SIZE."""

    def __init__(self, app, limit: int, larger: dict[str, int] | None = None):
        self.app, self.limit, self.larger = app, limit, larger or {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.larger.get(scope["path"], self.limit)
        too_large = ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _send_error(send, too_large)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its request
            body += message.get("body", b"")
            if len(body) > limit:
                return await _send_error(send, too_large)
            if not message.get("more_body"):
                break
        scope[BODY_SIZE] = len(body)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class _Auth:
    """With a key, every request but `GET /health` needs `Authorization: Bearer KEY` (health probes
    carry no key, as with llama.cpp's and vLLM's servers)."""

    def __init__(self, app, api_key: str | None):
        self.app, self.expected = app, (f"Bearer {api_key}".encode() if api_key else None)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.expected is not None and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return await _send_error(send, ApiError(
                    401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key"))
        await self.app(scope, receive, send)


# -- running it ----------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises the signal once it has shut down, so the process would die of it; a
        # server stopped by SIGTERM or Ctrl-C has done its job and exits 0. The second Ctrl-C forces.
        if threading.current_thread() is not threading.main_thread():
            yield  # (signals can only be handled on the main thread)
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads (so a taken port fails at once and
    `/health` answers 503 while loading)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def url_of(host: str, sock: socket.socket) -> str:
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run(options: ServeOptions, load: Callable[[], Loaded]) -> None:
    """Serve until SIGTERM/SIGINT, then let the requests in flight finish; a model that fails to load
    ends the server with that error."""
    sock = listen(options.host, options.port)
    url = url_of(options.host, sock)
    service = Service(load)
    uploads = options.api_key is not None or is_loopback(options.host)
    config = uvicorn.Config(create_app(service, options.api_key, uploads), log_level="info" if options.verbose else "warning",
                            access_log=options.verbose, lifespan="off", timeout_graceful_shutdown=None)
    server = _Server(config)

    def ready(ld: Loaded) -> None:
        print(f"minicpm: serving {ld.model} ({ld.backend}, {ld.device}) at {url}", file=sys.stderr, flush=True)

    def failed(e: BaseException) -> None:
        server.should_exit = True

    service.start(ready, failed)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if service.failure is not None:
        raise service.failure
    if service.ready:
        service.worker.stop(timeout=10)
