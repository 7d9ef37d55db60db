"""The speech API's endpoints, as one FastAPI router (`router`) over the `Service` in `app.state`.

Contract:
- `POST /v1/audio/speech`: OpenAI's speech request. Without `stream_format` the audio is the whole
  file `minicpm say -o FILE` writes (each segment decoded in one call); with `stream_format: "audio"`
  it is what `say -o -` streams (decoded chunk by chunk, sent as generated); `"sse"` carries the same
  bytes in `speech.audio.delta` events, then `speech.audio.done`. Extensions: `seed`, `greedy`,
  `first_chunk`, the `pcm_f32` format (the samples as generated, what the thin client asks for) and
  `voice_samples` (a reference voice's 16 kHz float32 samples, base64: what the thin client sends)
  and `timestamps: true`: the captions' cues (`captions.Cue.timestamp`), as `speech.caption` events
  in an sse stream (each once the next starts, the last before `speech.audio.done`), or, for a whole
  file (`pcm` and `pcm_f32` without `stream_format` too), a JSON response `{"audio": base64 file,
  "response_format", "sample_rate", "samples", "timestamps": [cues]}` (`stream_format: "audio"` has
  nowhere to put them: a 400).
  OpenAI's `speed` (0.25-4) is the tempo, the pitch kept; the reply endpoint takes it too.
- `POST /v1/audio/reply`: a spoken answer, as `minicpm reply`: server-sent events `reply.text.delta`,
  `reply.audio.delta`, then `reply.done` (the text; `usage`: `output_tokens`, the reply text's LLM
  tokens, and `audio_frames`, the audio frames spoken); with `timestamps: true`, `reply.caption`
  events too.
- `/v1/audio/speech/stream`: the speech socket, a WebSocket taking text as it arrives (`sockets.py`).
- `GET /health` (200 once the model is loaded and warm; `streams`: the requests on the model, generating,
  waiting for a row or, on the speech socket, for text), `GET /v1/models` (and `/v1/models/ID`: the
  one served, or an OpenAI TTS name it answers to), `GET /props` (what is
  served: model, backend, device, formats, limits), `GET /v1/voices` and `GET /v1/audio/voices` (the
  voices), `POST /v1/voices` (save one: multipart `name` and `file`).

Every endpoint answers 503 while the model loads. A request's chunks are generated on the service's
worker; the first is awaited before the response starts (a request that fails at once gets its
status), a later failure ends an event stream with an `error` event or cuts a raw stream. The
application (`app.create_app`) sets `app.state.service`, `app.state.voice_uploads` (whether
POST /v1/voices may save) and `app.state.started` (`/v1/models`' `created`).
"""

from __future__ import annotations

import asyncio
import base64
import io
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import captions, protocol
from ..audio import wav_header
from ..errors import UsageError, VoiceError
from ..voices.store import VoiceExists, VoiceStore, check_name
from .api_errors import ApiError, StreamAborted, internal_error, one_line
from .encoding import MEDIA_TYPES, encode, raw, sse
from .middleware import BODY_SIZE
from .schemas import AudioOptions, AudioRequest, ReplyRequest, SpeechRequest
from .service import Loaded, Service
from .worker import Job

router = APIRouter()


def service_of(request: Request) -> Service:
    """The application's service (a dependency: `app.create_app` puts it in `app.state`)."""
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(service_of)]


# -- what is served -----------------------------------------------------------------------------


@router.get("/health")
async def health(service: ServiceDep):
    service.require_ready()
    return {"status": "ok", "streams": service.worker.streams}


@router.get("/props")
async def props(service: ServiceDep):
    service.require_ready()
    return service.props()


@router.get("/v1/models")
async def models(request: Request, service: ServiceDep):
    ld = service.require_ready()
    return {"object": "list", "data": [_model(ld.model, request)]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request, service: ServiceDep):
    """One model (`client.models.retrieve`): the one served, or one of OpenAI's TTS names it answers to."""
    ld = service.require_ready()
    if model_id not in (ld.model, *protocol.MODEL_ALIASES):
        raise ApiError(404, f"the model '{model_id}' is not served here (this server serves '{ld.model}')",
                       param="model", code="model_not_found")
    return _model(model_id, request)


def _model(model_id: str, request: Request) -> dict:
    return {"id": model_id, "object": "model", "created": int(request.app.state.started), "owned_by": "minicpm"}


# -- voices ---------------------------------------------------------------------------------------


@router.get("/v1/audio/voices")
async def audio_voices(service: ServiceDep):
    service.require_ready()
    return {"voices": service.voice_names()}


@router.get("/v1/voices")
async def voices(service: ServiceDep):
    service.require_ready()
    saved = await asyncio.to_thread(_saved_voices, service.store)
    shadowed = {v["id"] for v in saved}
    default = {"id": protocol.DEFAULT_VOICE, "object": "voice", "kind": "builtin",
               "aliases": [n for n in protocol.OPENAI_VOICES if n not in shadowed]}
    return {"object": "list", "data": [default, *saved]}


@router.post("/v1/voices")
async def add_voice(request: Request, service: ServiceDep, name: str = Form(...), file: UploadFile = File(...),
                    force: bool = Form(False)):
    service.require_ready()
    if not request.app.state.voice_uploads:
        raise ApiError(403, "this server takes no voices over HTTP: one reachable from other machines needs "
                            "--api-key to accept them", code="voice_uploads_disabled")
    try:
        check_name(name)
    except UsageError as e:
        raise ApiError(400, one_line(str(e)), param="name") from None
    data, source = await file.read(), file.filename or "upload"
    try:
        saved = await asyncio.to_thread(service.store.add, name, io.BytesIO(data), force=force, source_name=source)
    except VoiceExists:
        raise ApiError(409, f"a voice named '{name}' is saved already (force=true replaces it)", param="name",
                       code="voice_exists") from None
    except VoiceError as e:
        raise ApiError(400, one_line(str(e)), param="file") from None
    return _voice_object(saved)


def _voice_object(v) -> dict:
    """A saved voice (voices.store.SavedVoice) as the voice endpoints show it."""
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


# -- speech and replies ---------------------------------------------------------------------------


@router.post("/v1/audio/speech")
async def speech(req: SpeechRequest, request: Request, service: ServiceDep):
    t0 = time.perf_counter()
    ld = service.require_ready()
    fmt = _check_common(req, ld, service, request)
    if req.instructions:
        raise ApiError(400, "instructions are not supported (one voice, read as written)", param="instructions")
    if req.stream_format is not None and req.stream_format not in protocol.STREAM_FORMATS:
        raise ApiError(400, f"unknown stream_format '{req.stream_format}' (audio or sse)", param="stream_format")
    if req.stream_format is not None and fmt not in protocol.STREAMABLE:
        raise ApiError(400, f"{fmt} comes as a whole file: leave stream_format out, or stream "
                            f"{', '.join(protocol.STREAMABLE)}", param="stream_format")
    if req.timestamps and req.stream_format == "audio":
        raise ApiError(400, "a raw audio stream has no room for timestamps: use stream_format sse, or none for "
                            "a JSON response", param="timestamps")
    voice = await service.voice(req)
    synth, sampling, frames = ld.synth, sampling_of(req), first_chunk_of(req)
    decode = "segment" if req.stream_format is None else "stream"
    timeline = captions.Timeline()
    usage = {"input_tokens": 0, "output_tokens": 0}

    def work(lane):
        usage["input_tokens"] = len(synth.tokenizers.encode_bert(req.input.strip()))
        return synth.synthesize(req.input, sampling, decode=decode, first_chunk=frames,
                                frames_per_token=ld.frames_per_token, voice=voice, lane=lane, speed=req.speed)

    job, end = await service.run(request, work)
    first = await first_block(job, end)
    # the server's own time to first audio (the worker's queue and hop included), for clients that
    # measure theirs (tools/serve_latency.py)
    timing = {"Server-Timing": f"first-chunk;dur={(time.perf_counter() - t0) * 1e3:.1f}"}
    rate = synth.sample_rate
    # a whole file (raw samples too, with timestamps: the JSON response is where they go)
    if req.stream_format is None and (fmt not in protocol.RAW_FORMATS or req.timestamps):
        try:
            chunks = [c async for c in _rest(job, first)]
        finally:
            end()
        samples = np.concatenate([c.samples for c in chunks]) if chunks else np.zeros(0, np.float32)
        data = raw(samples, fmt) if fmt in protocol.RAW_FORMATS else await asyncio.to_thread(encode, samples, fmt, rate)
        if req.timestamps:
            cues = captions.cues(chunks)
            return JSONResponse({"audio": _b64(data), "response_format": fmt, "sample_rate": rate,
                                 "samples": len(samples), "timestamps": [c.timestamp(rate) for c in cues]},
                                headers=timing)
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
                    for cue in timeline.add(chunk) if req.timestamps else ():
                        yield sse({"type": "speech.caption", **cue.timestamp(rate)})
                for cue in timeline.finish() if req.timestamps else ():
                    yield sse({"type": "speech.caption", **cue.timestamp(rate)})
                total = usage["input_tokens"] + usage["output_tokens"]
                yield sse({"type": "speech.audio.done", "usage": {**usage, "total_tokens": total}})
            except Exception as e:
                yield sse({"type": "error", **internal_error(e).body()})
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
            internal_error(e)
            raise StreamAborted from None
        finally:
            end()

    return StreamingResponse(body(), media_type=MEDIA_TYPES[fmt], headers=timing)


@router.post("/v1/audio/reply")
async def reply(req: ReplyRequest, request: Request, service: ServiceDep):
    ld = service.require_ready()
    fmt = _check_common(req, ld, service, request)
    if req.stream_format not in (None, "sse"):
        raise ApiError(400, "the reply endpoint streams server-sent events: stream_format is sse",
                       param="stream_format")
    if fmt not in protocol.STREAMABLE:
        raise ApiError(400, f"a reply is streamed: response_format is one of {', '.join(protocol.STREAMABLE)}",
                       param="response_format")
    if not 0 < req.temperature < float("inf"):
        raise ApiError(400, "temperature must be a positive number (use greedy for the most likely tokens)",
                       param="temperature")
    if req.max_tokens < 1:
        raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
    from ..engine.llm import LLMSampling

    voice = await service.voice(req)
    synth, sampling, frames = ld.synth, sampling_of(req), first_chunk_of(req)
    llm = LLMSampling(temperature=req.temperature)
    timeline, rate = captions.Timeline(), synth.sample_rate

    # output_tokens: the reply text's tokens in the LLM's vocabulary (counted on the worker, the
    # tokenizer's thread, once the reply ends); audio_frames: the audio frames spoken
    usage = {"output_tokens": 0, "audio_frames": 0}

    def work(lane):
        chunks = synth.reply(req.input, sampling, llm=llm, max_tokens=ld.reply_tokens or req.max_tokens,
                             first_chunk=frames, frames_per_token=ld.frames_per_token, voice=voice, lane=lane,
                             speed=req.speed)
        return _count_llm_tokens(chunks, synth.tokenizers, usage)

    job, end = await service.run(request, work)
    first = await first_block(job, end)
    head = wav_header(synth.sample_rate, "s16") if fmt == "wav" else b""

    async def events():
        said = []
        try:
            if head:
                yield sse({"type": "reply.audio.delta", "audio": _b64(head)})
            async for chunk in _rest(job, first):
                usage["audio_frames"] += len(chunk.codes)
                if len(chunk.samples):
                    yield sse({"type": "reply.audio.delta", "audio": _b64(raw(chunk.samples, fmt))})
                if chunk.text:
                    said.append(chunk.text)
                    yield sse({"type": "reply.text.delta", "text": chunk.text})
                for cue in timeline.add(chunk) if req.timestamps else ():
                    yield sse({"type": "reply.caption", **cue.timestamp(rate)})
            for cue in timeline.finish() if req.timestamps else ():
                yield sse({"type": "reply.caption", **cue.timestamp(rate)})
            yield sse({"type": "reply.done", "text": "".join(said), "usage": usage})
        except Exception as e:
            yield sse({"type": "error", **internal_error(e).body()})
        finally:
            end()

    return _event_stream(events())


def _count_llm_tokens(chunks: Iterator, tokenizers, usage: dict) -> Iterator:
    """A reply's chunks, passed through; once they end, `usage["output_tokens"]` is the number of
    LLM tokens of the text they carried."""
    said = []
    for chunk in chunks:
        said.append(chunk.text)
        yield chunk
    usage["output_tokens"] = len(tokenizers.encode_llm("".join(said)))


def _check_common(req: AudioRequest, ld: Loaded, service: Service, request: Request) -> str:
    """Checks shared by speech and reply (the voice apart); returns the response format."""
    check_size(request.scope.get(BODY_SIZE, 0), req)
    if len(req.input) > protocol.MAX_INPUT_CHARS:
        raise ApiError(413, f"the input has {len(req.input)} characters, more than the "
                            f"{protocol.MAX_INPUT_CHARS} a request takes", param="input", code="input_too_long")
    problem = protocol.not_unicode(req.input, "the input")
    if problem:
        raise ApiError(400, problem, param="input")
    return check_options(req, ld, service)


def check_size(size: int, req: AudioOptions) -> None:
    """A body (or the socket's start message) of `size` bytes holds at most MAX_BODY_BYTES besides its
    voice_samples, or a 413."""
    if size - len(req.voice_samples or "") > protocol.MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {protocol.MAX_BODY_BYTES} bytes (voice_samples apart)",
                       code="request_too_large")


def check_options(req: AudioOptions, ld: Loaded, service: Service) -> str:
    """The checks of what a speech or reply request (or the socket's start) asks for but its text,
    against the served model; returns the response format."""
    if req.model is not None and req.model not in (ld.model, *protocol.MODEL_ALIASES):
        raise ApiError(404, f"the model '{req.model}' is not served here (this server serves '{ld.model}')",
                       param="model", code="model_not_found")
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
    low, high = protocol.SPEED_RANGE
    if not low <= req.speed <= high:
        raise ApiError(400, f"speed must be between {low:g} and {high:g}", param="speed")
    if req.first_chunk is not None and not 1 <= req.first_chunk <= protocol.FRAMES_PER_CALL:
        raise ApiError(400, f"first_chunk must be between 1 and {protocol.FRAMES_PER_CALL} frames",
                       param="first_chunk")
    return fmt


def sampling_of(req: AudioOptions):
    from ..engine.sampling import Sampling

    return Sampling(greedy=req.greedy, seed=req.seed)


def first_chunk_of(req: AudioOptions) -> int:
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
        raise ApiError(400, one_line(str(e))) from None
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
