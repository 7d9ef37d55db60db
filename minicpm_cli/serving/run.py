"""`minicpm serve` in this process: the socket, uvicorn, the ready line, the exit.

Contract: `run(options, load)` binds `options.host:options.port` before the model loads (a taken
port is a UsageError at once, and `/health` answers 503 while loading), starts the service on
`load`, says `minicpm: serving MODEL (BACKEND, DEVICE) at URL` on stderr once it is warm, and serves
until SIGTERM or SIGINT, then lets the requests in flight finish and returns (exit status 0); a
model that fails to load ends the server with that error. Voice uploads are allowed with an API key
or on a loopback address only (`is_loopback`).

Stopping: new connections are refused at once; HTTP requests in flight finish, and speech sockets
whose input has ended are waited for to their end (a line on stderr says how many requests it waits
for; in one CI run such a socket, left unread by its client meanwhile, was still cut: 1006); a socket
still taking text gets the error `shutting_down` (503) and a close with 4503. A second Ctrl-C cuts
what is left: one line, exit status 130. Stopped while the model loads: SIGINT is "interrupted"
(130), SIGTERM 143, as any command, without waiting for the load.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn

from .. import protocol
from ..errors import UsageError
from .api_errors import ApiError
from .app import create_app
from .service import Loaded, Service



def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down: it takes no more text", code="shutting_down")


@dataclass(frozen=True)
class ServeOptions:
    host: str = protocol.DEFAULT_HOST
    port: int = protocol.DEFAULT_PORT  # 0: any free port (the ready line says which)
    api_key: str | None = None
    verbose: bool = False  # uvicorn's access log and startup lines
    socket_idle: float | None = protocol.SOCKET_IDLE_S  # a speech socket's wait for text (None: no limit)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig: int, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if self.force_exit:
            # (the requests cut end in CancelledErrors, which uvicorn would log as tracebacks)
            logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL + 1)
            sys.stderr.write("minicpm: interrupted: the requests in flight are cut\n")
        elif first and self.service.ready and self.service.worker.streams:
            n = self.service.worker.streams
            sys.stderr.write(f"minicpm: stopping: {n} request{'s' if n > 1 else ''} in flight to finish "
                             f"(Ctrl-C again cuts {'them' if n > 1 else 'it'})\n")

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn closes every WebSocket at once (1012): first the speech sockets whose input has
        # ended finish their audio, as HTTP requests in flight do, and those still taking text are
        # told why they end
        for server in self.servers:
            server.close()  # (no new connections meanwhile)
        waiting = set()
        for session in list(self.service.sockets):
            if session.ended or session.end_with(shutting_down()):
                waiting.add(session)
        while waiting & self.service.sockets and not self.force_exit:
            await asyncio.sleep(0.05)
        await super().shutdown(sockets)

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
    service = Service(load, socket_idle=options.socket_idle)
    uploads = options.api_key is not None or is_loopback(options.host)
    # (no per-message deflate on the speech socket: audio hardly compresses, and deflating every
    # chunk would cost time on the way to the first sound)
    config = uvicorn.Config(create_app(service, options.api_key, uploads), log_level="info" if options.verbose else "warning",
                            access_log=options.verbose, lifespan="off", timeout_graceful_shutdown=None,
                            ws="websockets-sansio", ws_per_message_deflate=False)
    server = _Server(config, service)

    def ready(ld: Loaded) -> None:
        print(f"minicpm: serving {ld.model} ({ld.backend}, {ld.device}) at {url}", file=sys.stderr, flush=True)

    def failed(e: BaseException) -> None:
        server.should_exit = True

    service.start(ready, failed)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if server.force_exit:  # (a second Ctrl-C: what was in flight is cut, said in handle_exit)
        raise KeyboardInterrupt
    if service.failure is not None:
        raise service.failure
    if not service.ready:  # (stopped while loading: the load is left to the process's exit)
        sig = server._captured_signals[-1] if server._captured_signals else signal.SIGINT
        if sig == signal.SIGINT:
            sys.stderr.write("minicpm: interrupted\n")
            raise KeyboardInterrupt
        raise SystemExit(128 + sig)
    service.worker.stop(timeout=10)
