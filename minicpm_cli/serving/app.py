"""The FastAPI application of `minicpm serve` (and of each Ray Serve replica), put together.

Contract: `create_app(service, api_key, voice_uploads)` returns an ASGI application over `service`
(a `service.Service`, loading or loaded): the routes of `routes.router` and the speech socket of
`sockets.router`, errors in OpenAI's shape
(`api_errors.add_handlers`), and the middlewares of `middleware`, outermost first: the guard, the
API key (when one is given), the body limit. It starts nothing: the caller starts the service and
runs the application (`run.run` on uvicorn, or Ray Serve's proxy).
"""

from __future__ import annotations

import time

from fastapi import FastAPI

from .. import __version__, protocol
from .api_errors import add_handlers
from .middleware import BODY_LIMITS, Auth, BodyLimit, Guard
from .routes import router
from .sockets import router as sockets
from .service import Service


def create_app(service: Service, api_key: str | None = None, voice_uploads: bool = True) -> FastAPI:
    """The application. `voice_uploads`: whether POST /v1/voices may save voices (`run.run` allows it
    with an API key or on a loopback address only)."""
    app = FastAPI(title="minicpm", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.state.voice_uploads = voice_uploads
    app.state.started = time.time()  # (`/v1/models`' `created`)
    add_handlers(app)
    app.include_router(router)
    app.include_router(sockets)
    # (the last added runs first: errors guarded, then the key checked, then the body read)
    app.add_middleware(BodyLimit, limit=protocol.MAX_BODY_BYTES, larger=BODY_LIMITS)
    app.add_middleware(Auth, api_key=api_key)
    app.add_middleware(Guard)
    return app
