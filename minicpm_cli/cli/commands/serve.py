"""`minicpm serve`: load the model once and serve the speech API (serving/), in this process or as
Ray Serve replicas (scale.ray_serve)."""

from __future__ import annotations

import functools
import math
from typing import Annotated, Optional

import typer

from ... import backends as registry
from ... import protocol
from ...errors import OptionError
from ..options import (BackendOpt, BatchVariantOpt, DeviceOpt, DtypeOpt, GgufOpt, GpusOpt, ModelOpt, RayOpt, ReplicasOpt,
                       absolute_if_here, check_model_options, check_ray)


def serve(
    model: ModelOpt = None,
    backend: BackendOpt = "auto",
    gguf: GgufOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    host: Annotated[str, typer.Option("--host", help="Address to listen on; one reachable from other machines needs --api-key (or --insecure).")] = protocol.DEFAULT_HOST,
    port: Annotated[int, typer.Option("--port", "-p", help="Port to listen on (0: any free port, named in the ready line).")] = protocol.DEFAULT_PORT,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar=protocol.API_KEY_ENV, help="Require 'Authorization: Bearer KEY' on every request but GET /health.", show_default=False)] = None,
    insecure: Annotated[bool, typer.Option("--insecure", help="Serve a non-loopback --host without an API key.")] = False,
    random_weights: Annotated[bool, typer.Option("--random-weights", help="For speed work (`bench --server`): the full-size model with random weights drawn on the device, no checkpoint; lengths forced as `bench --random-weights` forces them. Its audio is noise.")] = False,
    batch: Annotated[int, typer.Option("--batch", help="Requests generated at once (continuous batching); more queue. Each holds its own KV caches: ~0.4 GB of GPU memory a request in bfloat16. Default (0): as many as the GPU's free memory holds, at most 16 (8 on a CPU). The gguf backend runs one at a time.")] = 0,
    socket_idle: Annotated[float, typer.Option("--socket-idle", metavar="SECONDS", help="Close a speech socket (/v1/audio/speech/stream) whose stream has waited this long for text before the text's end came (4408 idle_timeout): a waiting stream holds one of --batch's places. 0: never.")] = protocol.SOCKET_IDLE_S,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every request on stderr.")] = False,
    ray_address: RayOpt = None,
    replicas: ReplicasOpt = None,
    gpus_per_replica: GpusOpt = None,
    batch_variant: BatchVariantOpt = False,
) -> None:
    """Load the model once and serve it: an OpenAI-compatible speech API (POST /v1/audio/speech), spoken
    replies (POST /v1/audio/reply), saved voices (GET/POST /v1/voices), GET /health. Runs until SIGTERM
    or Ctrl-C, then finishes the requests in flight and exits 0.

    One line on stderr says when it is ready. `say` and `reply` use it when it runs at their default
    address (else set MINICPM_SERVER or give --server URL). With --ray the same application runs on
    Ray Serve: --replicas model replicas behind Serve's HTTP proxy at --host/--port.
    """
    if not 0 <= port <= 65535:
        raise OptionError("--port must be between 0 and 65535")
    if batch < 0:
        raise OptionError("--batch must be at least 1 (0: as many as fit)")
    if not (math.isfinite(socket_idle) and socket_idle >= 0):
        raise OptionError("--socket-idle must be a number of seconds (0: no limit)")
    idle = socket_idle or None
    address, bounds = check_ray(ray_address, replicas, gpus_per_replica)
    api_key = api_key or None
    from ...serving import run as srv
    from ...serving.service import load_served

    if not srv.is_loopback(host) and api_key is None and not insecure:
        raise OptionError(f"--host {host} can be reached from other machines: give --api-key KEY (or set "
                          f"{protocol.API_KEY_ENV}), or --insecure to serve it without a key")
    check_model_options(backend, device, dtype, gguf)
    if backend != registry.AUTO:
        be = registry.get(backend)
        if address is None:  # (with --ray, what counts is what the replicas have installed)
            be.check()

    if address is not None:
        from ...scale import cluster

        cluster.require_ray("serve")
        from ...scale import ray_serve

        args = ray_serve.ServeArgs(model=absolute_if_here(model), backend=backend, gguf=absolute_if_here(gguf), device=device, dtype=dtype,
                                   random_weights=random_weights, batch=batch, api_key=api_key, socket_idle=idle,
                                   replicas=bounds or (1, 1),
                                   gpus=gpus_per_replica, batch_variant=batch_variant)
        ray_serve.deploy(args, address=address, host=host, port=port)
        return
    srv.run(srv.ServeOptions(host=host, port=port, api_key=api_key, verbose=verbose, socket_idle=idle),
            functools.partial(load_served, model, backend, device, dtype, gguf, random_weights, batch, batch_variant))
