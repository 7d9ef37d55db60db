"""Errors as the API answers them: OpenAI's error object with its status, in one line.

Contract: every error a client sees has the body `{"error": {"message", "type", "param", "code"}}`
and one of these statuses: 400 bad value, 401 key, 403 voice uploads refused, 404 model or path, 405
method, 409 voice name taken, 413 too large, 422 malformed, 503 loading, 500 our fault. `ApiError`
is raised by the routes and answered by the handler `add_handlers` installs, which also answers
FastAPI's own errors (malformed bodies, unknown paths, wrong methods) in this shape. A failure of
ours becomes a 500 through `internal_error`, which says it in one line on stderr (the traceback only
with MINICPM_DEBUG=1); a streamed response that fails after it started raises `StreamAborted`, and
the guard middleware drops its connection. The server stays up after any of them.
"""

from __future__ import annotations

import os
import sys

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import MinicpmError, UsageError


class ApiError(Exception):
    """An error response: status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


LOADING = ApiError(503, "the model is loading", code="model_loading", kind="service_unavailable")


class StreamAborted(Exception):
    """A streamed response that failed after it started: its connection is dropped, so the client
    sees the body end before its end (said once on stderr, by `internal_error`)."""


def one_line(text: str) -> str:
    return " ".join(text.split())


def internal_error(e: BaseException) -> ApiError:
    """A failure of ours: one line on the server's stderr (the traceback with MINICPM_DEBUG=1) and a
    500 whose message names it. (A UsageError is the request's fault: a 400, said nowhere else.)"""
    if isinstance(e, UsageError):
        return ApiError(400, one_line(str(e)))
    message = one_line(str(e)) if isinstance(e, MinicpmError) else one_line(f"{type(e).__name__}: {e}")
    if os.environ.get("MINICPM_DEBUG"):
        import traceback

        traceback.print_exception(e, file=sys.stderr)
    print(f"minicpm: error in a request: {message}", file=sys.stderr, flush=True)
    return ApiError(500, message, kind="server_error", code="internal_error")


async def api_error(request: Request, e: ApiError) -> JSONResponse:
    return e.response()


def invalid(errors: list, what: str = "the body") -> ApiError:
    """Validation errors (pydantic's, FastAPI's) as a 422 naming the first field at fault; `what` was
    not JSON at all: `invalid_json`."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return ApiError(422, f"{what} is not valid JSON ({first.get('ctx', {}).get('error', 'invalid')})",
                        code="invalid_json")
    where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    if where:
        message = f"{where}: {first.get('msg', 'invalid request')}"
    else:  # (the whole of it: empty, not an object, or a body sent as another type than JSON: `curl -d`)
        how = " sent with Content-Type: application/json" if what == "the body" else ""
        message = f"{what} must be a JSON object{how} ({first.get('msg', 'invalid request')})"
    return ApiError(422, one_line(message), param=where or None, code="invalid_request")


async def invalid_request(request: Request, e: RequestValidationError) -> JSONResponse:
    """A body that is not JSON, or not the schema: 422, naming the first field at fault."""
    return invalid(e.errors()).response()


async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (no such path, wrong method) in OpenAI's shape."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    message = f"{request.method} {request.url.path}: {e.detail}"
    return ApiError(e.status_code, message, code=code).response()


def add_handlers(app: FastAPI) -> None:
    """Answer ApiError, validation errors and Starlette's HTTP errors in OpenAI's shape."""
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
