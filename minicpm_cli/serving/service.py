"""The served model and its lifecycle: loading, warm-up, readiness, the queue of jobs, voices.

Contract: `Service(load)` owns one `Loaded` model and the `worker.Worker` thread that alone touches
it. `start` loads (and warms up) on that thread and reports readiness or failure once; until then
`require_ready` raises the API's 503. `run` queues one request's generation (requests run in arrival
order, chunk by chunk, while the event loop keeps answering) and cancels it when its client
disconnects, queued or running: the generator stops after the chunk being generated (`submit`
queues one for a caller that watches its client itself: the speech socket). `voice`
resolves a request's `voice`/`voice_samples` into what the model is given, or a 400 that lists the
voices: a saved voice of `store` (the directory `minicpm voice add` writes, read at each request),
None for `default` and for OpenAI's names unless a saved voice has the name, or the thin client's
samples. (The model's voice encoder keeps the encodings, keyed by the samples' hash, so a saved
voice is encoded once.) `load_served` is what `minicpm serve` and each Ray Serve replica load.
Nothing here knows routes or backends: what to load is decided by the caller.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
from starlette.requests import Request

from .. import __version__, protocol
from ..errors import VoiceError
from ..voices.reference import Voice
from ..voices.store import UnknownVoice, VoiceStore, locate
from .api_errors import LOADING, ApiError, one_line
from .encoding import writable_formats
from .schemas import AudioOptions
from .worker import Job, Worker


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
                random_weights: bool, rows: int = 1, batch_variant: bool = False) -> Loaded:
    """Load what `serve` serves (here, or in a Ray Serve replica), `rows` requests at once: a Loaded
    (`batch_variant`: the faster kernels whose rounding depends on the batch)."""
    from ..engine import loading

    synth, name, model_id = loading.load(model, backend, device, dtype, gguf, rows=rows, random_weights=random_weights,
                                         batch_invariant=not batch_variant)
    path = Path(model_id).expanduser()
    return Loaded(synth, model="random-weights" if random_weights else model_id, backend=name,
                  device=str(synth.device), dtype=str(synth.tts.dtype).removeprefix("torch."),
                  path=str(path.resolve()) if path.is_dir() and not random_weights else None, gguf=gguf,
                  environment=loading.environment(synth.device),
                  frames_per_token=loading.FORCED_FRAMES_PER_TOKEN if random_weights else None,
                  reply_tokens=loading.FORCED_REPLY_TOKENS if random_weights else None)


class Service:
    """The model and its state: loading, then ready (after a warm-up) or failed."""

    def __init__(self, load: Callable[[], Loaded], warm_up: bool = True, store: VoiceStore | None = None,
                 socket_idle: float | None = protocol.SOCKET_IDLE_S):
        self.loaded: Loaded | None = None
        self.store = store or VoiceStore()
        self.failure: BaseException | None = None
        self.formats = writable_formats()
        self.worker = Worker()
        self.sockets: set = set()  # the speech sockets' sessions open (sockets.Session), for a shutdown
        self.socket_idle = socket_idle  # seconds a socket's stream may wait for text (None: no limit)
        self._load, self._warm_up = load, warm_up
        self._ready = threading.Event()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def require_ready(self) -> Loaded:
        """The loaded model, or the API's 503 while it loads."""
        if not self.ready:
            raise LOADING
        return self.loaded

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
                           "max_upload_bytes": protocol.MAX_UPLOAD_BYTES, "socket_idle_s": self.socket_idle},
                "extensions": ["voice_samples", "speed", "speech_stream"],
                "forced_lengths": None if ld.frames_per_token is None else
                {"frames_per_token": ld.frames_per_token, "reply_tokens": ld.reply_tokens},
                "environment": ld.environment}

    def voice_names(self) -> list[str]:
        return [protocol.DEFAULT_VOICE, *self.store.names()]

    async def voice(self, req: AudioOptions) -> Voice | None:
        """The voice a request asks for (None: the model's own), or a 400 that lists the voices."""
        name = req.voice_name
        if req.voice_samples is not None:
            if name != protocol.DEFAULT_VOICE:
                raise ApiError(400, f"give voice '{name}' or voice_samples, not both", param="voice_samples")
            return await asyncio.to_thread(decode_samples, req.voice_samples)
        try:
            # the rule `say --voice` and bulk follow, but names only (no file on the server's disk) and
            # OpenAI's names too; a stat of the store at most, so on the event loop
            path = locate(name, self.store, files=False, openai_names=True)
            return None if path is None else await asyncio.to_thread(self.store.load, name)
        except UnknownVoice:
            raise ApiError(400, f"unknown voice '{name}' (voices: {', '.join(self.voice_names())}; OpenAI's names "
                                "speak the default voice unless a saved voice has the name)", param="voice") from None
        except VoiceError as e:
            raise ApiError(400, one_line(str(e)), param="voice") from None

    async def run(self, request: Request, work: Callable[[], Iterable]) -> tuple[Job, Callable[[], None]]:
        """Queue `work` (a function returning the request's chunks); returns the job and a function
        that ends it. The job is cancelled as soon as the client disconnects, queued or running."""
        job = self.submit(work)
        watcher = asyncio.create_task(_watch(request, job))

        def end() -> None:
            job.cancel()
            watcher.cancel()

        return job, end

    def submit(self, work: Callable[[], Iterable]) -> Job:
        """Queue `work` as `run` does, for a caller that watches its client itself (the speech socket)
        and cancels the job when it leaves."""
        job = Job(work, asyncio.get_running_loop())
        self.worker.submit_job(job)
        return job


async def _watch(request: Request, job: Job) -> None:
    # (the body has been read: the next message is the disconnect, or the end of the response)
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


def decode_samples(text: str) -> Voice:
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
        raise ApiError(400, one_line(str(e)), param="voice_samples") from None


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
