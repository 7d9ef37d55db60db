"""Serving: `minicpm serve`'s OpenAI-compatible speech API and the thin client that talks to it.

Owns the request schemas, the OpenAI error shape, the service's lifecycle (loading, warm-up,
readiness), the routes, the middlewares, the worker thread that runs the model, socket binding,
and the client (`say`/`reply`/`bench --server` through a running server; no torch).

The server, by module: `schemas` (request bodies), `api_errors` (OpenAI's error object, the 500s),
`encoding` (audio bytes of responses), `service` (the model's lifecycle, the job queue, voices),
`worker` (the one thread that touches the model), `routes` (the endpoints, an APIRouter), `sockets`
(the speech socket: a WebSocket, text in as it arrives, audio out),
`middleware` (guard, API key, body limit), `app` (`create_app`, the assembly), `run` (sockets and
uvicorn: `minicpm serve` in this process).

May import the engine and voices and the shared leaves. Never the command line or scale-out
(`scale.ray_serve` deploys this package's application, not the reverse).
"""
