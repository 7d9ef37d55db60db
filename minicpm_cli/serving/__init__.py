"""Serving: `minicpm serve`'s OpenAI-compatible speech API and the thin client that talks to it.

Owns the request schemas, the OpenAI error shape, the service's lifecycle (loading, warm-up,
readiness), the routes, the middlewares, the worker thread that runs the model, socket binding,
and the client (`say`/`reply`/`bench --server` through a running server; no torch).

May import the engine and voices and the shared leaves. Never the command line or scale-out
(`scale.ray_serve` deploys this package's application, not the reverse).
"""
