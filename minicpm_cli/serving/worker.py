"""The one thread that touches the model, and the jobs it runs for the event loop.

`Worker` runs functions one at a time, in the order submitted, on its own thread: the model's CUDA
state (current stream, graphs captured at warm-up) and torch's thread-local modes stay on one thread.
`Job` is one request's generation, handing each item (an audio chunk) to the asyncio loop as soon as
it exists; the loop reads them with `await job.next()`. Without an engine the worker runs each job
whole, in arrival order; with one (`Worker.engine`, a `batching.Engine`), jobs become streams of a
batch: the worker runs the engine's rounds while any stream is running and picks up every new job
between two rounds, so a request joins the running batch at the next step, and requests that came
together join in the same round. When every stream of the engine
is parked (waiting for text that has not come: `batching.Engine.stalled`) the worker sleeps until a
job comes or `wake()` is called (from any thread: text came for a parked stream, or it was
cancelled). `cancel()`, from the loop, stops a job after the item being generated (the generator is
closed on the worker thread, so its cleanup runs there); a job cancelled before its turn never
starts. Nothing here knows HTTP or the model.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Iterable

_END = object()
_NOTHING = object()  # a wake-up
_EMPTY = object()  # (the queue had nothing)


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Job:
    """One request's generation (`work(lane)` returns its iterator of chunks; lane None when run
    alone), for a Worker to run."""

    def __init__(self, work: Callable[..., Iterable], loop: asyncio.AbstractEventLoop):
        self.work, self.loop = work, loop
        self.items: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self._stream = None

    def cancel(self) -> None:
        self._cancelled.set()
        if self._stream is not None:
            self._stream.cancel()

    def interrupt(self, error: BaseException) -> None:
        """(On the loop) `next()` raises `error` once the items already handed over are read: the
        caller learnt something that ends the job (its client left, or sent what cannot be served)."""
        self.items.put_nowait(_Failed(error))

    def stream(self, ended: Callable[[], None] = lambda: None):
        """This job as a stream of a batch (batching.Stream), on the worker thread; `ended()` once it
        has ended."""
        from ..engine.batching import Stream

        def done(error: BaseException | None) -> None:
            self._put(_END if error is None else _Failed(error))
            ended()

        self._stream = Stream(self.work, self._put, done)
        if self._cancelled.is_set():
            self._stream.cancel()
        return self._stream

    def run(self) -> None:  # on the worker thread
        if self._cancelled.is_set():
            self._put(_END)
            return
        chunks = None
        try:
            chunks = self.work(None)
            for item in chunks:
                self._put(item)
                if self._cancelled.is_set():
                    break
        except BaseException as e:  # (whatever it is, the thread goes on to the next job)
            self._put(_Failed(e))
            return
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()  # a generator stopped early runs its cleanup here, on this thread
        self._put(_END)

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutting down): nobody is waiting
            pass

    async def next(self):
        """The next item; StopAsyncIteration at the end; the work's exception if it failed."""
        item = await self.items.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, _Failed):
            raise item.error
        return item


class Worker:
    """The one thread that touches the model. Functions run one at a time, in the order submitted;
    jobs (`submit_job`) run whole in turn, or as streams of `engine` once one is set (on this thread).
    `streams`: the jobs taken and not yet ended (waiting for a row, generating, or waiting for text),
    written on this thread only."""

    def __init__(self):
        self.engine = None
        self.streams = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._woken = False  # a wake-up is in the queue, not yet taken
        self._thread = threading.Thread(target=self._loop, name="minicpm-model", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        self._queue.put(fn)

    def submit_job(self, job: Job) -> None:
        def start() -> None:
            self.streams += 1
            if self.engine is not None:
                self.engine.submit(job.stream(self._ended))
                return
            try:
                job.run()
            finally:
                self._ended()

        self.submit(start)

    def _ended(self) -> None:
        self.streams -= 1

    def wake(self) -> None:
        """Have the engine look at its parked streams again (any thread); a sleeping worker wakes."""
        if not self._woken:  # (one wake-up in the queue is enough: new jobs wait behind each one)
            self._woken = True
            self._queue.put(_NOTHING)

    def stop(self, timeout: float | None = None) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _next(self, block: bool):
        """The queue's next item, or _EMPTY where it has none and `block` is False."""
        try:
            return self._queue.get() if block else self._queue.get_nowait()
        except queue.Empty:
            return _EMPTY

    def _loop(self) -> None:
        while True:
            engine = self.engine
            busy = engine is not None and not engine.idle and not engine.stalled
            # while a batch runs, new work is picked up between two of its rounds, all of it: requests
            # that came together start in one round (their prompts prefilled together), not one a
            # round (16 replies sent at once to an H100: TTFA p50 406 ms so, 189 all at once)
            fn = self._next(block=not busy)
            while fn is not None and fn is not _EMPTY:
                if fn is _NOTHING:
                    self._woken = False  # (before the round looks: a later wake() queues another)
                else:
                    fn()
                fn = self._next(block=False)
            if fn is None:
                break
            if self.engine is not None and not self.engine.idle:
                self.engine.round()
        if self.engine is not None:  # (stopping: the requests in flight have ended by now; a stream
            self.engine.run()  # still waiting for text is cancelled, as none will come)
