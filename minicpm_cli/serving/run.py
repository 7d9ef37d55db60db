"""`minicpm serve` in this process: the socket, uvicorn, the ready line, the exit.

Contract: `run(options, load)` binds `options.host:options.port` before the model loads (a taken
port is a UsageError at once, and `/health` answers 503 while loading), starts the service on
`load`, says `minicpm: serving MODEL (BACKEND, DEVICE) at URL` on stderr once it is warm, and serves
until SIGTERM or SIGINT, then lets the requests in flight finish and returns (exit status 0); a
model that fails to load ends the server with that error. Voice uploads are allowed with an API key
or on a loopback address only (`is_loopback`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn

from .. import protocol
from ..errors import UsageError
from .app import create_app
from .service import Loaded, Service


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
    # (no per-message deflate on the speech socket: audio hardly compresses, and deflating every
    # chunk would cost time on the way to the first sound)
    config = uvicorn.Config(create_app(service, options.api_key, uploads), log_level="info" if options.verbose else "warning",
                            access_log=options.verbose, lifespan="off", timeout_graceful_shutdown=None,
                            ws="websockets-sansio", ws_per_message_deflate=False)
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
