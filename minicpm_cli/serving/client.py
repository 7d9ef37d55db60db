"""The thin client: `say`, `reply` and `bench` speaking through a running `minicpm serve`.

`Remote` offers what the commands need from a loaded model, `read(text, ...)` and
`reply(message, ...)` as iterators of chunks (float32 samples, sample rate, text), so the commands
write them with the same sinks as when the model runs in-process, and the bytes are the same. It
asks the server for `pcm_f32`, the samples exactly as generated, or, for a sink that writes its own
format as it comes (stdout, --raw, a 16-bit WAV file: `audio.takes_pcm`), for that format (`pcm`
s16le or `pcm_f32`, converted by the server with the sink's own `audio.to_pcm`): `read` over the
speech endpoint (`stream_format: "audio"` for a streamed decode, none for the per-segment one),
`reply` over the reply endpoint's server-sent events (text and audio deltas), `read_arriving` (text
still arriving on a pipe) over the speech socket (`/v1/audio/speech/stream`, a WebSocket: each
arrival sent as it comes, the audio read as it is made). A voice (`--voice FILE`
or a saved NAME, resolved here) goes along with each request as its samples (`voice_samples`: base64
float32 16 kHz, exactly what the local path would give the model), so the server needs no copy of it
and the bytes are the local path's; the server encodes each voice once and keeps the encoding.

Standard library, numpy for float samples only, and `websockets` for the speech socket only: no
torch, no model code (the point of a server
is that `say` starts in milliseconds; `say -o -` and `-o FILE.wav` through one do not import numpy).
`find` asks the server one question, `GET /props` (503 while it loads, then what it serves). `read`
and `reply` send their request at once, so that the server works while the caller gets ready to
write (imports numpy if it needs it, opens its sink); the response is read as the chunks are asked
for. Each request is its own connection; closing it (the iterator closed, Ctrl-C) is how the server
learns to stop that generation.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from .. import protocol, trace
from ..audio import PCM_BYTES, Pcm
from ..errors import MinicpmError, OptionError, UsageError

if TYPE_CHECKING:
    import numpy as np

DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32"}  # the aliases --dtype takes
# the response_format asked for: a sink's own samples (s16le, f32le), or float32 samples for numpy
FORMAT_OF = {**{pcm: fmt for fmt, pcm in protocol.RAW_FORMATS.items()}, None: "pcm_f32"}


class ServerError(MinicpmError):
    """The server failed, went away mid-response, or does not answer as a minicpm server."""


@dataclass(frozen=True)
class Chunk:
    """What `say`/`reply` read from an AudioChunk: samples (float32 mono, or a sink's own `Pcm`), their
    rate, the text; with `timestamps`, the caption cues the server timed (`captions.Timeline` takes
    them) and, at a request's end, an empty chunk that is `final` (the next request's cues follow it)."""

    samples: np.ndarray | Pcm
    sample_rate: int
    text: str = ""
    cues: tuple = ()
    final: bool = False


def server_url(explicit: str | None) -> tuple[str | None, bool]:
    """(the URL to try or None for none, whether it was asked for explicitly with --server)."""
    if explicit is not None:
        return explicit, True
    env = os.environ.get(protocol.SERVER_ENV)
    if env is None:
        return protocol.DEFAULT_URL, False
    return (env.strip() or None), False


class Remote:
    """A minicpm server, used as `say`/`reply` use the model in-process."""

    def __init__(self, url: str, props: dict, api_key: str | None):
        self.url, self.props, self.api_key = url, props, api_key
        self.sample_rate = int(props["sample_rate"])
        self.voice = None  # a voice.Voice: every request speaks in it (see `take_voice`)
        self._voice_samples: str | None = None

    # -- finding one ---------------------------------------------------------------------------

    @classmethod
    def find(cls, url: str | None, explicit: bool) -> "Remote | None":
        """The server at `url`, once it answers as ready (it is waited for while it loads); None when
        nothing answers there and it was not asked for explicitly, else an error that says why. One
        request a try, `GET /props`: 503 while the model loads (as `/health`), then what is served."""
        if url is None:
            return None
        base = _base(url)
        api_key = os.environ.get(protocol.API_KEY_ENV) or None
        said = False
        while True:
            try:
                status, body = _request(base, "GET", "/props", api_key=api_key, timeout=5.0 if explicit else 1.0)
            except OSError as e:
                if explicit:
                    raise UsageError(f"no server answers at {url}: {_reason(e)}") from None
                return None
            except http.client.HTTPException:  # (something listens there that does not answer HTTP)
                if explicit:
                    raise UsageError(f"no minicpm server at {url} (what answers there does not speak HTTP)") from None
                return None
            error = _error_of(body)
            if status == 503 and error.get("code") == "model_loading":
                if not said:
                    print(f"minicpm: waiting for the server at {url} to load its model", file=sys.stderr, flush=True)
                    said = True
                time.sleep(0.5)
                continue
            props = _json(body) if status == 200 else {}
            if "sample_rate" in props:
                trace.mark("found")
                return cls(base, props, api_key)
            if error.get("code") in ("invalid_api_key", "internal_error"):
                _raise(url, status, body)  # ours: the key missing or wrong, or a failure
            if explicit:
                raise UsageError(f"no minicpm server at {url} (GET /props answered {status})")
            return None  # something else listens on the default address: not ours

    def check(self, *, model: str | None, backend: str, device: str, dtype: str, gguf: str | None) -> None:
        """Refuse what the server cannot honour: another model, backend, device, dtype or GGUF file
        than it serves (options left at their defaults ask for nothing)."""
        p = self.props
        wrong = []
        if model is not None and not _same_model(model, p):
            wrong.append(f"model {p['model']}, not {model}")
        if backend != "auto" and backend != p["backend"]:
            wrong.append(f"backend {p['backend']}, not {backend}")
        if device != "auto" and device != p["device"] and device != p["device"].split(":")[0]:
            wrong.append(f"device {p['device']}, not {device}")
        if dtype != "auto" and DTYPE_NAMES.get(dtype, dtype) != p["dtype"]:
            wrong.append(f"dtype {p['dtype']}, not {dtype}")
        if gguf is not None and not _same_path(gguf, p.get("gguf")):
            wrong.append(f"GGUF {p.get('gguf') or '(none)'}, not {gguf}")
        if wrong:
            raise UsageError(f"the server at {self.url} serves {'; '.join(wrong)}: use --local to load "
                             "it in this process, or --server URL for a server that has it")

    def take_voice(self, voice) -> None:
        """Speak every request in `voice` (a voice.Voice, or None for the model's own), sent as its
        samples; a server that does not take them is an error, never the default voice instead."""
        if voice is not None and "voice_samples" not in self.props.get("extensions", ()):
            raise UsageError(f"the server at {self.url} does not take voices (an older minicpm): add --local to "
                             "clone the voice in this process")
        self.voice = voice
        self._voice_samples = None if voice is None else \
            base64.b64encode(voice.samples.astype("<f4", copy=False).tobytes()).decode("ascii")

    def describe(self) -> str:
        p = self.props
        return f"server {self.url}: backend {p['backend']}, device {p['device']}, model {p['model']}"

    # -- speaking ------------------------------------------------------------------------------

    def _speech(self, greedy: bool, seed: int | None, first_chunk: int, speed: float, pcm: str | None) -> dict:
        """The speech request's options (the speech endpoint's body, the socket's `start`), less its text."""
        return {"model": self.props["model"], "voice": protocol.DEFAULT_VOICE, "voice_samples": self._voice_samples,
                "response_format": FORMAT_OF[pcm], "greedy": greedy, "seed": seed, "first_chunk": first_chunk,
                "speed": self._speed(speed)}

    def read(self, text: str, *, greedy: bool, seed: int | None, decode: str, first_chunk: int,
             speed: float = 1.0, pcm: str | None = None, timestamps: bool = False) -> Iterator[Chunk]:
        """`Synthesizer.synthesize` on the server: decode "stream" (chunk by chunk) or "segment". With
        `pcm` ("s16" or "f32", for a sink that writes it as it comes: `audio.takes_pcm`) the server
        converts the samples as that sink would (`audio.to_pcm`) and the chunks hold `audio.Pcm`;
        else float32 samples. With `timestamps` (captions) the text goes whole, as the end message, over
        the speech socket, which sends the cues beside the same audio (`Chunk.cues`)."""
        if timestamps:
            start = self._socket_start(greedy, seed, decode, first_chunk, speed, pcm)
            return _sent(self._arriving(start, {"type": "end", "text": text}, iter(()), pcm, _Opening(self)))
        body = {**self._speech(greedy, seed, first_chunk, speed, pcm), "input": text}
        if decode == "stream":
            body["stream_format"] = "audio"
        return _sent(self._samples(body, pcm))

    def read_arriving(self, arrivals, *, greedy: bool, seed: int | None, decode: str, first_chunk: int,
                      speed: float = 1.0, pcm: str | None = None, timestamps: bool = False) -> Iterator[Chunk]:
        """Text still arriving ((text, ended) items: `streams.arriving`), through the server's speech
        socket: each arrival is sent as one message as it comes and the audio is read as it is made, so
        the server makes of them the parts, segments and bytes `--local` makes of the same arrivals.
        Text that comes whole (the input ended with its first arrival) is one speech request, as
        `read` sends it; so is all of it for a server without the socket (an older minicpm), sent
        once the input has ended."""
        arrivals = iter(arrivals)
        socket_ok = "speech_stream" in self.props.get("extensions", ())
        # (the socket opens while the writer writes: importing websockets and the handshake cost tens of
        # ms that would otherwise fall between the first arrival and its audio; unused if the text
        # comes whole)
        opening = _Opening(self) if socket_ok else None
        try:
            first, ended = next(arrivals)
        except BaseException:
            if opening is not None:
                opening.discard()
            raise
        options = dict(greedy=greedy, seed=seed, decode=decode, first_chunk=first_chunk, speed=speed, pcm=pcm,
                       timestamps=timestamps)
        if not ended and not socket_ok:
            first, ended = first + "".join(t for t, _ in arrivals), True
        if ended:
            if opening is not None:
                opening.discard()
            if not first.strip():
                raise UsageError("no text to speak")
            return self.read(first.strip(), **options)
        start = self._socket_start(greedy, seed, decode, first_chunk, speed, pcm, timestamps)
        return _sent(self._arriving(start, {"type": "text", "text": first}, arrivals, pcm, opening))

    def _check_timed(self) -> None:
        """Captions need a server that times them beside the audio (the speech socket came with the
        reply stream's `timestamps`): an older minicpm is an error, never a file without its cues."""
        if "speech_stream" not in self.props.get("extensions", ()):
            raise UsageError(f"the server at {self.url} does not time captions (an older minicpm): add --local")

    def _socket_start(self, greedy: bool, seed: int | None, decode: str, first_chunk: int, speed: float,
                      pcm: str | None, timestamps: bool = True) -> dict:
        """The speech socket's start message (with `timestamps`, `_check_timed` first)."""
        if timestamps:
            self._check_timed()
        start = {"type": "start", **self._speech(greedy, seed, first_chunk, speed, pcm)}
        start = {k: v for k, v in start.items() if v is not None}
        start["stream_format"] = "audio" if decode == "stream" else None  # (null: each segment decoded whole)
        if timestamps:
            start["timestamps"] = True
        return start

    def _arriving(self, start: dict, first: dict, arrivals: Iterator, pcm: str | None,
                  opening: "_Opening") -> Iterator[Chunk]:
        from websockets.exceptions import ConnectionClosed

        ws = opening.socket()
        failed: list[BaseException] = []
        with ws:
            try:
                ws.send(json.dumps(start))
                ws.send(json.dumps(first))
            except ConnectionClosed:
                pass  # (the server's error message is read below)
            trace.mark("sent")
            idle = self.props.get("limits", {}).get("socket_idle_s")
            threading.Thread(target=_send_arrivals, args=(ws, arrivals, failed, idle), daemon=True,
                             name="minicpm-text").start()
            yield None  # (sent: see _sent)
            samples = _samples_of(pcm)
            while True:
                try:
                    message = ws.recv()
                except ConnectionClosed as e:
                    if failed:
                        raise failed[0] from None
                    raise ServerError(f"the server at {self.url} closed the speech socket before the end of the "
                                      f"audio ({e})") from None
                if isinstance(message, bytes):
                    yield Chunk(samples(message), self.sample_rate)
                    continue
                event = _json(message.encode())
                if event.get("type") == "speech.caption":
                    yield Chunk(samples(b""), self.sample_rate, cues=(event,))
                elif event.get("type") == "speech.audio.done":
                    yield Chunk(samples(b""), self.sample_rate, final=True)
                    return
                if event.get("type") == "error":
                    code = 0
                    try:
                        ws.recv(timeout=5)  # (the close that follows carries the status)
                    except ConnectionClosed as e:
                        code = e.rcvd.code if e.rcvd is not None else 0
                    except TimeoutError:
                        pass
                    _raise(self.url, code - protocol.WS_CLOSE_ERROR if code > protocol.WS_CLOSE_ERROR else 500,
                           message.encode())

    def _speed(self, speed: float) -> float | None:
        """The request's `speed` (None, left out, at 1: what any server takes); a server that does not
        take it on every endpoint (an older minicpm, whose reply endpoint would ignore it) is an error,
        never audio at another tempo than asked for."""
        if speed == 1.0:
            return None
        if "speed" not in self.props.get("extensions", ()):
            raise UsageError(f"the server at {self.url} does not take --speed (an older minicpm): add --local")
        return speed

    def _samples(self, body: dict, pcm: str | None) -> Iterator[Chunk]:
        with self._post("/v1/audio/speech", body) as conn:
            yield None  # (sent: see _sent)
            samples = _samples_of(pcm)
            resp = self._response(conn)
            size, pending = PCM_BYTES[pcm or "f32"], b""
            for data in _chunks(resp, self.url):
                pending += data
                whole = len(pending) - len(pending) % size
                if whole:
                    yield Chunk(samples(pending[:whole]), self.sample_rate)
                    pending = pending[whole:]
            if pending:
                raise ServerError(f"the server at {self.url} sent a partial sample")

    def read_many(self, texts: Iterable[str], *, batch: int, **options) -> Iterator[list[Chunk]]:
        """`read` of each text, `batch` requests in flight at once (the server batches them); each
        text's chunks as a list, in input order."""
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(batch, thread_name_prefix="minicpm-read")
        pending: deque = deque()
        try:
            for text in texts:
                pending.append(pool.submit(lambda t: list(self.read(t, **options)), text))
                if len(pending) >= batch:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            # (the requests in flight are not waited for: after Ctrl-C the command leaves at once, and
            # the connections its exit closes stop their generation on the server)
            pool.shutdown(wait=False, cancel_futures=True)

    def reply(self, message: str, *, greedy: bool, seed: int | None, temperature: float, max_tokens: int,
              first_chunk: int, speed: float = 1.0, pcm: str | None = None, timestamps: bool = False) -> Iterator[Chunk]:
        """`Synthesizer.reply` on the server: audio and the text it speaks, as they are generated (`pcm`
        and `timestamps` as for `read`)."""
        if timestamps:
            self._check_timed()
        body = {"model": self.props["model"], "input": message, "voice": protocol.DEFAULT_VOICE,
                "voice_samples": self._voice_samples, "response_format": FORMAT_OF[pcm], "stream_format": "sse",
                "greedy": greedy, "seed": seed,
                "temperature": temperature, "max_tokens": max_tokens, "first_chunk": first_chunk,
                "speed": self._speed(speed), **({"timestamps": True} if timestamps else {})}
        return _sent(self._replies(body, pcm))

    def _replies(self, body: dict, pcm: str | None) -> Iterator[Chunk]:
        with self._post("/v1/audio/reply", body) as conn:
            yield None  # (sent: see _sent)
            samples = _samples_of(pcm)
            resp = self._response(conn)
            empty = samples(b"")
            for event in _events(resp, self.url):
                kind = event.get("type")
                if kind == "reply.audio.delta":
                    yield Chunk(samples(base64.b64decode(event["audio"])), self.sample_rate)
                elif kind == "reply.text.delta":
                    yield Chunk(empty, self.sample_rate, event["text"])
                elif kind == "reply.caption":
                    yield Chunk(empty, self.sample_rate, cues=(event,))
                elif kind == "reply.done":
                    return
                elif kind == "error":
                    raise ServerError(f"the server at {self.url} failed: {event['error']['message']}")
            raise ServerError(f"the server at {self.url} ended the reply without its done event")

    @contextlib.contextmanager
    def _post(self, path: str, body: dict) -> Iterator[http.client.HTTPConnection]:
        """A connection with the request written to it; leaving the `with` closes it (the server stops there)."""
        conn = _connection(self.url, timeout=None)
        headers = {"Content-Type": "application/json", **_auth(self.api_key)}
        try:
            conn.request("POST", _path(self.url, path), body=json.dumps({k: v for k, v in body.items() if v is not None}),
                         headers=headers)
        except OSError as e:
            conn.close()
            raise ServerError(f"the server at {self.url} went away: {_reason(e)}") from None
        trace.mark("sent")
        try:
            yield conn
        finally:
            conn.close()

    def _response(self, conn: http.client.HTTPConnection) -> http.client.HTTPResponse:
        """The response's status and headers (an error status raised as ours)."""
        try:
            resp = conn.getresponse()
        except OSError as e:
            raise ServerError(f"the server at {self.url} went away: {_reason(e)}") from None
        trace.mark("response", server_timing=resp.getheader("Server-Timing"))
        if resp.status != 200:
            _raise(self.url, resp.status, resp.read())
        return resp


KEEPALIVE_S = 20.0  # the most time between two messages of `say` on a speech socket while its input is quiet


def _send_arrivals(ws, arrivals: Iterator, failed: list, idle: float | None = None) -> None:
    """Each arrival as one message (the last, with the end, as the end message), on a thread of its
    own while the audio is read. Reading the input may fail (not UTF-8): the failure is kept for the
    reader and the socket closed, which cancels the server's work. While the input is quiet, an empty
    text message goes out each third of the server's `idle` limit (`serve --socket-idle`; at most
    KEEPALIVE_S apart), so that a writer that pauses (`tail -f`) keeps its stream: an empty arrival
    adds nothing to speak (`text.ready_parts`), so the audio is what it would be without."""
    from websockets.exceptions import ConnectionClosed

    lock, done = threading.Lock(), threading.Event()  # (nothing may follow the end message)

    def send(message: str, last: bool = False) -> None:
        with lock:
            if not done.is_set():
                ws.send(message)
                if last:
                    done.set()

    def keep_alive(every: float) -> None:
        while not done.wait(every):
            try:
                send('{"type":"text","text":""}')
            except ConnectionClosed:
                return

    if idle:
        threading.Thread(target=keep_alive, args=(min(idle / 3, KEEPALIVE_S),), daemon=True,
                         name="minicpm-keepalive").start()
    try:
        for text, ended in arrivals:
            send(json.dumps({"type": "end" if ended else "text", "text": text}), last=ended)
            if ended:
                return
    except ConnectionClosed:
        pass  # (the server ended the session: the reader says why)
    except BaseException as e:
        failed.append(e)
        ws.close()
    finally:
        done.set()


def _samples_of(pcm: str | None) -> Callable[[bytes], "np.ndarray | Pcm"]:
    """The server's bytes as a chunk's samples: `Pcm` as they are, else float32 samples (numpy imported
    here, once the request is on its way)."""
    if pcm is not None:
        return lambda data: Pcm(data, pcm)
    import numpy as np

    return lambda data: np.frombuffer(data, dtype="<f4").astype(np.float32)


def _sent(chunks: Iterator[Chunk]) -> Iterator[Chunk]:
    """Run a request's generator up to its first `yield`, where the request has been sent: the server
    starts on it now, not when the first chunk is asked for."""
    next(chunks)
    return chunks


def _chunks(resp: http.client.HTTPResponse, url: str) -> Iterator[bytes]:
    """The body as it arrives (one read per network delivery), to its verified end."""
    while True:
        try:
            data = resp.read1(1 << 16)
        except (http.client.IncompleteRead, OSError) as e:
            raise ServerError(f"the server at {url} stopped in the middle of the audio ({_reason(e)})") from None
        if not data:
            if resp.length:  # a Content-Length body cut short
                raise ServerError(f"the server at {url} stopped in the middle of the audio")
            return
        yield data


def _events(resp: http.client.HTTPResponse, url: str) -> Iterator[dict]:
    """Server-sent events' JSON data, one dict per event."""
    buffer = b""
    for data in _chunks(resp, url):
        buffer += data.replace(b"\r\n", b"\n")
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            lines = [line[5:].lstrip() for line in block.split(b"\n") if line.startswith(b"data:")]
            if lines:
                yield json.loads(b"\n".join(lines))


# -- plumbing ------------------------------------------------------------------------------------


def _base(url: str) -> str:
    """The server's root URL (a trailing /v1, as OpenAI clients are given it, is dropped)."""
    base = url.strip().rstrip("/")
    if "://" not in base:
        base = "http://" + base
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OptionError(f"not an http:// URL: {url}")
    try:
        parts.port  # (raises for a port that is not a number from 0 to 65535)
    except ValueError:
        raise OptionError(f"not an http:// URL: {url} (its port is not a number from 0 to 65535)") from None
    return base[:-3] if base.endswith("/v1") else base


class _Opening:
    """The speech socket of `remote`, opened on a thread of its own from now on; `socket()` waits for
    it (a refusal raised there as ServerError), `discard()` closes it unused."""

    def __init__(self, remote: "Remote"):
        self.url, self.api_key = remote.url, remote.api_key
        self.done = threading.Event()
        self.ws, self.error = None, None
        threading.Thread(target=self._open, daemon=True, name="minicpm-socket").start()

    def _open(self) -> None:
        try:
            from websockets.exceptions import WebSocketException
            from websockets.sync.client import connect

            try:
                # (no compression: audio hardly compresses; no size limit: a segment decoded whole is one message)
                self.ws = connect(_ws_url(self.url, protocol.SPEECH_STREAM_PATH), additional_headers=_auth(self.api_key),
                                  compression=None, max_size=None, open_timeout=30)
            except (OSError, WebSocketException) as e:
                self.error = ServerError(f"the server at {self.url} refused the speech socket: {_reason(e)}")
        except BaseException as e:  # (handed to the caller of socket())
            self.error = e
        finally:
            self.done.set()

    def socket(self):
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.ws

    def discard(self) -> None:
        def close() -> None:
            self.done.wait()
            if self.ws is not None:
                self.ws.close()

        threading.Thread(target=close, daemon=True, name="minicpm-socket-close").start()


def _ws_url(base: str, path: str) -> str:
    parts = urlsplit(base)
    return f"{'wss' if parts.scheme == 'https' else 'ws'}://{parts.netloc}{_path(base, path)}"


def _connection(base: str, timeout: float | None) -> http.client.HTTPConnection:
    parts = urlsplit(base)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return cls(parts.hostname, parts.port, timeout=timeout)


def _path(base: str, path: str) -> str:
    return urlsplit(base).path.rstrip("/") + path


def _auth(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _request(base: str, method: str, path: str, *, api_key: str | None = None,
             timeout: float | None = 30.0) -> tuple[int, bytes]:
    conn = _connection(base, timeout)
    try:
        conn.request(method, _path(base, path), headers=_auth(api_key))
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _json(body: bytes) -> dict:
    try:
        value = json.loads(body)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _error_of(body: bytes) -> dict:
    error = _json(body).get("error")
    return error if isinstance(error, dict) else {}


def _raise(url: str, status: int, body: bytes):
    """An error response as one of our exceptions: the server's message (OpenAI's error object)."""
    message = _error_of(body).get("message") or f"HTTP {status}"
    if status == 401:
        how = "set MINICPM_API_KEY to its key" if not os.environ.get(protocol.API_KEY_ENV) else "check MINICPM_API_KEY"
        raise UsageError(f"the server at {url} refused the request ({message}): {how}")
    if status == 413:
        raise UsageError(f"{message} (the server at {url}; use --local to read it in this process)")
    if status < 500:
        raise UsageError(message)
    raise ServerError(f"the server at {url} failed: {message}")


def _reason(e: BaseException) -> str:
    if isinstance(e, socket.timeout):
        return "timed out"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


def _same_path(asked: str, served: str | None) -> bool:
    if served is None:
        return False
    if asked == served:
        return True
    a, b = Path(asked).expanduser(), Path(served).expanduser()
    return a.exists() and b.exists() and a.resolve() == b.resolve()


def _same_model(asked: str, props: dict) -> bool:
    return asked == props["model"] or _same_path(asked, props.get("path"))
