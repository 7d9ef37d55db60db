"""The application's plain-ASGI middlewares: the guard, the body limit, the API key.

Contract, outermost first (`app.create_app` adds them in the reverse order): `Guard` turns an
exception no handler took into a 500 in OpenAI's shape, or drops the connection once the response
has started; `Auth` answers 401 to a request without the key (all but `GET /health`); `BodyLimit`
reads the whole body first, answers 413 past the path's limit, and leaves the body's size in the
scope under `BODY_SIZE` for the routes.
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


class Guard:
    """The last line: an exception no handler took becomes a 500 in OpenAI's shape (and one line on
    stderr, never a traceback), or, once the response has started, a dropped connection."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        started = False

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except StreamAborted:
            pass  # (uvicorn closes the connection: the chunked body never gets its last chunk)
        except Exception as e:
            error = internal_error(e)
            if not started:
                await _send_error(send, error)


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
    carry no key, as with llama.cpp's and vLLM's servers)."""

    def __init__(self, app, api_key: str | None):
        self.app, self.expected = app, (f"Bearer {api_key}".encode() if api_key else None)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.expected is not None and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return await _send_error(send, ApiError(
                    401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key"))
        await self.app(scope, receive, send)
