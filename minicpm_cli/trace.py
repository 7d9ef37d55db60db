"""Startup phases as JSON lines in $MINICPM_STARTUP_LOG, for `minicpm bench --startup` and, through a
server, the thin client's phases for `tools/serve_latency.py` (start, cli imported, options parsed,
server found, request sent, response headers in, file written).

`mark(event, **info)` notes a moment (wall-clock seconds since the epoch, comparable with the parent's
clock; the response's mark carries the server's own time to first audio, its Server-Timing header),
`span(name)` the duration of a piece of work (summed by name by the reader; its end and process
too, for a timeline of several processes). Without the variable both
cost a dictionary lookup; nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

ENV = "MINICPM_STARTUP_LOG"


def _write(record: dict) -> None:
    path = os.environ.get(ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def mark(event: str, **info) -> None:
    _write({"event": event, "t": time.time(), "pid": os.getpid(), **info})


@contextmanager
def span(name: str, **info):
    if not os.environ.get(ENV):
        yield
        return
    t = time.perf_counter()
    try:
        yield
    finally:
        _write({"span": name, "s": time.perf_counter() - t, "end": time.time(), "pid": os.getpid(), **info})
