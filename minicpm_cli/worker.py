"""The one thread that touches the model, and the jobs it runs for the event loop.

`Worker` runs functions one at a time, in the order submitted, on its own thread: the model's CUDA
state (current stream, graphs captured at warm-up) and torch's thread-local modes stay on one thread,
and generations never overlap. `Job` is one request's generation: the worker runs it whole, handing
each item (an audio chunk) to the asyncio loop as soon as it exists; the loop reads them with
`await job.next()`. `cancel()`, from the loop, stops a job after the item being generated (the
generator is closed on the worker thread, so its cleanup runs there); a job cancelled before its turn
never starts. Nothing here knows HTTP or the model.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Iterable

_END = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Job:
    """One request's generation (`work` returns its iterator of chunks), for a Worker to run."""

    def __init__(self, work: Callable[[], Iterable], loop: asyncio.AbstractEventLoop):
        self.work, self.loop = work, loop
        self.items: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    def run(self) -> None:  # on the worker thread
        if self._cancelled.is_set():
            self._put(_END)
            return
        chunks = None
        try:
            chunks = self.work()
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
    """The one thread that touches the model. Functions run one at a time, in the order submitted."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="minicpm-model", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        self._queue.put(fn)

    def stop(self, timeout: float | None = None) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while (fn := self._queue.get()) is not None:
            fn()
