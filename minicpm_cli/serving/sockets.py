"""The speech socket, `/v1/audio/speech/stream`: text in as it arrives, audio out as it is made (a
WebSocket, for agents feeding a language model's tokens, and for `say --server` reading a pipe).

Contract (docs/streaming.md, "The speech socket"). The client's first message is `{"type": "start",
...}` with the speech endpoint's options but `input` (`schemas.StreamStart`, checked as that endpoint
checks them); then `{"type": "text", "text": ...}` as the text comes, `{"type": "flush"}` to have
all pending text spoken now and `{"type": "end"}` when it ends (a flush or the end may carry text).
Each message is one arrival of `Synthesizer.synthesize_arriving` (`engine.inbox`), so the parts, the
segments and the audio are those `say` makes in-process of the same arrivals. The server sends the
audio as binary messages (the response format's bytes, a WAV header first for wav) and JSON events:
`speech.segment.started` (segment, start), `speech.segment.done` (segment, text, start, end: the
caption cues' fields, counted from the stream's first sample), with `timestamps: true` the
`speech.caption` events of the speech endpoint's sse stream, and at the end `speech.audio.done`
(usage), then a close with 1000. An error is `{"type": "error", "error": {...}}` (OpenAI's error
object, as the HTTP API's) and a close with 4000 + the status it has over HTTP. The client closing
the socket cancels the generation: its stream, waiting for text or generating, ends and frees its
row. A stream that has waited `Service.socket_idle` seconds for text (its input not ended; the wait
for the start message counts too) ends with 408 (`idle_timeout`): a parked stream holds a row. The
API key is the middleware's (`middleware.Auth`: a header, or a subprotocol).

While it waits for text the stream is parked on the model's thread (`batching.Lane.park`), so the
other requests go on; text is handed over with no copy but the message's, and each chunk's bytes go
out as one binary message as soon as the worker hands the chunk to the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from .. import captions, protocol
from ..audio import wav_header
from ..engine.inbox import Inbox
from .api_errors import ApiError, internal_error, invalid
from .encoding import raw
from .middleware import socket_error, subprotocol
from .routes import check_options, check_size, first_chunk_of, sampling_of
from .schemas import StreamStart, StreamText
from .service import Service
from .worker import Job

router = APIRouter()


class _ClientLeft(Exception):
    """The client closed the socket, or its connection went."""


class Session:
    """What a shutdown needs of an open socket (`Service.sockets`): whether its input has ended (its
    audio is then finished, as an HTTP request in flight is), and how to end it with an error."""

    def __init__(self):
        self.ended = False
        self.stop = None  # (error) -> None, once its job runs
        self.opening = None  # the wait for the start message (a task), until it has come
        self.refused = None  # the error that ended that wait

    def end_with(self, error: ApiError) -> bool:
        """End a socket still taking text with `error` (one still waiting for its start message too);
        False if it has nothing to end yet."""
        if self.stop is None:
            if self.opening is None or self.opening.done():
                return False
            self.refused = error
            self.opening.cancel()
            return True
        self.stop(error)
        return True


@router.websocket(protocol.SPEECH_STREAM_PATH)
async def speech_stream(ws: WebSocket) -> None:
    await ws.accept(subprotocol=subprotocol(ws.scope))
    service: Service = ws.app.state.service
    job = inbox = reader = None
    session = Session()
    service.sockets.add(session)
    try:
        ld = service.require_ready()
        session.opening = asyncio.ensure_future(_first(ws, service.socket_idle))
        try:
            first = await session.opening
        except asyncio.CancelledError:
            if session.refused is None:
                raise
            raise session.refused from None
        start = _start(first)
        fmt = _check(start, ld, service)
        voice = await service.voice(start)
        synth, sampling, frames, speed = ld.synth, sampling_of(start), first_chunk_of(start), start.speed
        decode = "stream" if start.stream_format == "audio" else "segment"
        inbox = Inbox(service.worker.wake)
        usage = {"input_tokens": 0, "output_tokens": 0}

        def work(lane):
            arrivals = inbox.arrivals(lane.park if lane is not None else None)
            yield from synth.synthesize_arriving(arrivals, sampling, decode=decode, first_chunk=frames,
                                                 frames_per_token=ld.frames_per_token, voice=voice, speed=speed,
                                                 lane=lane)
            usage["input_tokens"] = len(synth.tokenizers.encode_bert(inbox.received.strip()))

        job = service.submit(work)
        session.stop = functools.partial(_stop, inbox, job)
        reader = asyncio.create_task(_read(ws, inbox, job, session, service.socket_idle))
        await _speak(ws, job, fmt, synth.sample_rate, start.timestamps, usage)
        await ws.close(1000)
    except (_ClientLeft, WebSocketDisconnect):
        pass
    except ApiError as e:
        await _end(ws, e)
    except Exception as e:
        await _end(ws, internal_error(e))
    finally:
        service.sockets.discard(session)
        if reader is not None:
            reader.cancel()
        if job is not None:
            job.cancel()
        if inbox is not None:
            inbox.close()  # (a parked stream is resumed, to end)


async def _receive(ws: WebSocket) -> str:
    message = await ws.receive()
    if message["type"] == "websocket.disconnect":
        raise _ClientLeft
    if message.get("text") is None:
        raise ApiError(400, 'messages are JSON text: {"type": "start" | "text" | "flush" | "end", ...}',
                       code="invalid_message")
    return message["text"]


_IDLE_POLL_S = 1.0  # how often a socket's reader looks whether its stream has begun to wait


def _idle(limit: float) -> ApiError:
    return ApiError(408, f"no text came for {limit:g} s while the stream waited for it (a waiting stream holds one "
                         f"of the server's places): send the text's end (\"type\": \"end\") once it is all sent",
                    code="idle_timeout")


async def _first(ws: WebSocket, limit: float | None) -> str:
    """The start message, within `limit` seconds of the connection (None: no limit)."""
    try:
        return await asyncio.wait_for(_receive(ws), limit)
    except asyncio.TimeoutError:
        raise _idle(limit) from None


def _parse(model, text: str, what: str):
    """A message as `model`, or the 422 naming the first field at fault. pydantic's JSON parser refuses
    a JSON string holding an unpaired surrogate ("\\ud800") as not JSON; it is JSON, so such a message
    is parsed by Python's and validated, and the text's own check says what is wrong with it (400), as
    the speech endpoint says it."""
    try:
        return model.model_validate_json(text)
    except ValidationError as e:
        errors = e.errors()
    if errors and errors[0].get("type") == "json_invalid":
        try:
            data = json.loads(text)
        except ValueError:
            raise invalid(errors, what) from None
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise invalid(e.errors(), what) from None
    raise invalid(errors, what) from None


def _start(text: str) -> StreamStart:
    start = _parse(StreamStart, text, "the start message")
    check_size(len(text), start)
    return start


def _check(start: StreamStart, ld, service: Service) -> str:
    """The speech endpoint's checks of the options, and the socket's own; the response format."""
    fmt = check_options(start, ld, service)
    if start.stream_format not in ("audio", None):
        raise ApiError(400, "the socket's stream_format is audio (each call decoded as generated) or null "
                            "(each segment in one call)", param="stream_format")
    if fmt not in protocol.STREAMABLE:
        raise ApiError(400, f"{fmt} comes as a whole file: the socket streams {', '.join(protocol.STREAMABLE)}",
                       param="response_format")
    return fmt


def _stop(inbox: Inbox, job: Job, error: Exception) -> None:
    """End the session with `error`: its job cancelled, its parked stream resumed to end, the error
    raised to the sender next."""
    job.cancel()
    inbox.close()
    job.interrupt(error)


async def _read(ws: WebSocket, inbox: Inbox, job: Job, session: Session, limit: float | None) -> None:
    """The client's messages into the inbox until it leaves. What ends the session here (the client
    leaving, a message that cannot be taken, `limit` seconds of the stream waiting for text before its
    input ended) cancels the job and is raised to the sender next. The wait counts only while the
    stream has nothing to speak (`Inbox.waiting_since`): not while it queues for a row or generates."""
    received, ended, pending, last = 0, False, None, time.monotonic()
    try:
        while True:
            pending = asyncio.ensure_future(_receive(ws))
            while not ended and limit is not None and not pending.done():
                since = inbox.waiting_since  # (a message put since is not yet taken: the wait counts from it)
                left = limit if since is None else limit - (time.monotonic() - max(since, last))
                if left <= 0:
                    raise _idle(limit)
                await asyncio.wait({pending}, timeout=min(left, _IDLE_POLL_S))
            text = await pending
            if len(text) > protocol.MAX_BODY_BYTES:
                raise ApiError(413, f"a message is larger than {protocol.MAX_BODY_BYTES} bytes",
                               code="request_too_large")
            message = _parse(StreamText, text, "the message")
            problem = protocol.not_unicode(message.text, "the text")
            if problem:
                raise ApiError(400, problem, param="text")
            if ended:
                raise ApiError(400, "the input has ended: nothing may follow the end message", param="type")
            received += len(message.text)
            if received > protocol.MAX_INPUT_CHARS:
                raise ApiError(413, f"the input has more than the {protocol.MAX_INPUT_CHARS} characters a request "
                                    "takes", param="text", code="input_too_long")
            ended = session.ended = message.type == "end"
            inbox.put(message.text, ended=ended, flush=message.type == "flush")
            last = time.monotonic()
    except asyncio.CancelledError:
        raise
    except Exception as e:  # (_ClientLeft, WebSocketDisconnect, ApiError)
        _stop(inbox, job, e)
    finally:
        if pending is not None:
            pending.cancel()


def _event(kind: str, **fields) -> str:
    return json.dumps({"type": kind, **fields}, separators=(",", ":"))


async def _speak(ws: WebSocket, job: Job, fmt: str, rate: int, timestamps: bool, usage: dict) -> None:
    """The job's chunks as binary messages, with the segment events (and the captions), then
    `speech.audio.done`. A segment starts at the sample its first chunk starts at and ends at its
    last chunk's end (`AudioChunk.ends_segment`)."""
    if fmt == "wav":
        await ws.send_bytes(wav_header(rate, "s16"))
    timeline = captions.Timeline()
    sent, segment, begin, said, open_ = 0, None, 0, [], False

    async def segment_done() -> None:
        cue = captions.Cue(begin, sent, " ".join("".join(said).split()))
        await ws.send_text(_event("speech.segment.done", segment=segment, **cue.timestamp(rate)))

    while True:
        try:
            chunk = await job.next()
        except StopAsyncIteration:
            break
        if chunk.segment != segment:
            if open_:
                await segment_done()
            segment, begin, said, open_ = chunk.segment, sent, [], True
            await ws.send_text(_event("speech.segment.started", segment=segment, start=round(sent / rate, 6),
                                      start_sample=sent))
        usage["output_tokens"] += len(chunk.codes)  # audio frames
        if len(chunk.samples):
            await ws.send_bytes(raw(chunk.samples, fmt))
            sent += len(chunk.samples)
        said.append(chunk.text)
        for cue in timeline.add(chunk) if timestamps else ():
            await ws.send_text(_event("speech.caption", **cue.timestamp(rate)))
        if chunk.ends_segment and open_:
            await segment_done()
            open_ = False
    if open_:
        await segment_done()
    for cue in timeline.finish() if timestamps else ():
        await ws.send_text(_event("speech.caption", **cue.timestamp(rate)))
    total = usage["input_tokens"] + usage["output_tokens"]
    await ws.send_text(_event("speech.audio.done", usage={**usage, "total_tokens": total}))


async def _end(ws: WebSocket, error: ApiError) -> None:
    """The error message and the close (the client may have gone meanwhile: nothing to tell then)."""
    try:
        for message in socket_error(error):
            await ws.send(message)
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass
