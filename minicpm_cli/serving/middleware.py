"""The application's plain-ASGI middlewares: the guard, the body limit, the API key.

Contract, outermost first (`app.create_app` adds them in the reverse order): `Guard` turns an
exception no handler took into a 500 in OpenAI's shape, or drops the connection once the response
has started (a WebSocket: refused, or closed with an error message and 4500); `Auth` answers 401 to
a request without the key (all but `GET /health`; a WebSocket without it is accepted, sent the error
and closed with 4401, which a browser can read where it could not read a refused handshake);
`BodyLimit` reads the whole body first, answers 413 past the path's limit, and leaves the body's
size in the scope under `BODY_SIZE` for the routes.
"""

from __future__ import annotations

import hmac
import json

from .. import protocol
from .api_errors import ApiError, StreamAborted, internal_error

# Paths whose bodies may be larger than MAX_BODY_BYTES: requests that may carry voice_samples (whose
# other fields the routes hold to MAX_BODY_BYTES, knowing the size from BODY_SIZE) and uploads.
BODY_LIMITS = {"/v1/audio/speech": protocol.MAX_VOICE_BODY_BYTES, "/v1/audio/reply": protocol.MAX_VOICE_BODY_BYTES,
               "/v1/voices": protocol.MAX_UPLOAD_BYTES}
BODY_SIZE = "minicpm.body_bytes"  # the request's scope key for its body's size


async def _send_error(send, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def subprotocol(scope) -> str | None:
    """The subprotocol a WebSocket is accepted with: `minicpm` when the client offered it."""
    return protocol.WS_SUBPROTOCOL if protocol.WS_SUBPROTOCOL in (scope.get("subprotocols") or ()) else None


def socket_error(error: ApiError) -> list[dict]:
    """The ASGI messages that end an accepted WebSocket with `error`: the error as a JSON message
    (`{"type": "error", "error": {...}}`), then a close with 4000 + its status (the reason, the
    message cut to the 123 bytes a close frame holds)."""
    reason = error.message.encode()[:120].decode(errors="ignore")
    return [{"type": "websocket.send", "text": json.dumps({"type": "error", **error.body()}, separators=(",", ":"))},
            {"type": "websocket.close", "code": protocol.WS_CLOSE_ERROR + error.status, "reason": reason}]


async def _refuse_socket(scope, receive, send, error: ApiError) -> None:
    if (await receive())["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept", "subprotocol": subprotocol(scope)})
    for message in socket_error(error):
        await send(message)


class Guard:
    """The last line: an exception no handler took becomes a 500 in OpenAI's shape (and one line on
    stderr, never a traceback), or, once the response has started, a dropped connection."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        sent: set[str] = set()

        async def sending(message):
            sent.add(message["type"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except StreamAborted:
            pass  # (uvicorn closes the connection: the chunked body never gets its last chunk)
        except Exception as e:
            error = internal_error(e)
            if scope["type"] == "http" and "http.response.start" not in sent:
                await _send_error(send, error)
            elif scope["type"] == "websocket" and "websocket.close" not in sent:
                for message in socket_error(error) if "websocket.accept" in sent else [{"type": "websocket.close"}]:
                    await send(message)


class BodyLimit:
    """Reads the whole request body first, answering 413 as soon as it passes `limit` bytes (the
    path's own limit in `larger`); the size is left in the scope under BODY_SIZE."""

    def __init__(self, app, limit: int, larger: dict[str, int] | None = None):
        self.app, self.limit, self.larger = app, limit, larger or {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.larger.get(scope["path"], self.limit)
        too_large = ApiError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _send_error(send, too_large)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its request
            body += message.get("body", b"")
            if len(body) > limit:
                return await _send_error(send, too_large)
            if not message.get("more_body"):
                break
        scope[BODY_SIZE] = len(body)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class Auth:
    """With a key, every request but `GET /health` needs `Authorization: Bearer KEY` (health probes
    carry no key, as with llama.cpp's and vLLM's servers); a WebSocket may instead offer the
    subprotocol `minicpm.key.KEY` (browsers cannot set headers; a query string would put the key in
    access logs)."""

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and self.expected is not None and scope["path"] != "/health":
            if not self._allowed(scope):
                error = ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                                 code="invalid_api_key")
                if scope["type"] == "websocket":
                    return await _refuse_socket(scope, receive, send, error)
                return await _send_error(send, error)
        await self.app(scope, receive, send)

    def _allowed(self, scope) -> bool:
        if hmac.compare_digest(dict(scope["headers"]).get(b"authorization", b""), self.expected):
            return True
        key = (protocol.WS_KEY_PREFIX + self.api_key).encode()
        offered = (scope.get("subprotocols") or ()) if scope["type"] == "websocket" else ()
        return any(hmac.compare_digest(p.encode(), key) for p in offered)
