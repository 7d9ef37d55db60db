"""Text that arrives from another thread for one read (a server's socket), as the arrivals
`Synthesizer.synthesize_arriving` reads.

The producer (any thread: the server's event loop) calls `put` for each message as it comes and
`close` when the reader must stop (its client left). The consumer, on the model's thread, iterates
`arrivals(park)`: each message is one `text.Arrival`, in order, never merged with the next (so the
parts, hence the audio, depend only on the messages, not on when they were read), until the one that
ends the input. While nothing has come, a stream of a batch parks (`park`, its lane's: the engine
runs the other streams and polls this inbox each round) and a read alone waits on a condition; once
closed, the next arrival asked for raises `Closed`. `wake` (given by the owner) is called after each
put and at close, so that an engine with only parked streams, which sleeps, looks again.
`waiting_since` says since when the reader has waited for text (monotonic seconds; None while it has
text or has not asked), for an idle limit. No torch.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from .text import Arrival


class Closed(Exception):
    """The inbox was closed while its reader waited for text (its client left)."""


class Inbox:
    def __init__(self, wake: Callable[[], None] = lambda: None):
        self._items: deque[Arrival] = deque()
        self._closed = False
        self._cond = threading.Condition()
        self._wake = wake
        self.received = ""  # all the text put so far
        self.waiting_since: float | None = None  # (set and cleared by the reader's thread only)

    # -- the producer's side (any thread) --------------------------------------------------------

    def put(self, text: str, ended: bool = False, flush: bool = False) -> None:
        self.received += text
        with self._cond:
            self._items.append(Arrival(text, ended, flush))
            self._cond.notify()
        self._wake()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._wake()

    # -- the reader's side (the model's thread) --------------------------------------------------

    def has_news(self) -> bool:
        """Whether a wait would end now: text has come, or the inbox was closed."""
        return bool(self._items) or self._closed

    def arrivals(self, park: Callable[[Callable[[], bool]], None] | None = None) -> Iterator[Arrival]:
        """The messages as `Arrival`s, to the one that ends the input. `park(ready)`: wait, as a
        stream of a batch, until `ready()` (None: block this thread)."""
        while True:
            if not self.has_news():
                self.waiting_since = time.monotonic()
            while not self.has_news():
                if park is not None:
                    park(self.has_news)
                else:
                    with self._cond:
                        self._cond.wait_for(self.has_news)
            self.waiting_since = None
            if self._closed:
                raise Closed
            item = self._items.popleft()
            yield item
            if item.ended:
                return
