"""`minicpm serve` on Ray Serve: the same application, one model per replica, scaled by Ray.

`app(args)` builds the Serve application from a dict of options (`ServeArgs.from_args`: model,
backend, gguf, device, dtype, random_weights, batch, batch_variant, api_key, replicas "N" or
"MIN-MAX", gpus, max_ongoing_requests, target_ongoing_requests, socket_idle), so that `serve run minicpm_cli.scale.ray_serve:app
model=DIR replicas=1-4` and a KubeRay RayService (`import_path: minicpm_cli.scale.ray_serve:app` with the
same `args`) deploy it; `minicpm serve --ray ADDRESS` deploys it from the command line (`deploy`).

Each replica is a `Speech` actor holding one model: its constructor loads the model and warms it up
(`serving.service.Service`, as `minicpm serve` does) and Serve routes requests to it only once that
is done. It serves `serving.app.create_app`, the FastAPI application of `minicpm serve` unchanged:
the same routes, OpenAI's error objects, the API key, the per-replica request queue on one model
thread, streamed responses sent chunk by chunk through Serve's HTTP proxy. Replicas are placed with
`gpus` GPUs each (`ray_actor_options.num_gpus`), a fixed number of them or as many as the ongoing
requests call for between MIN and MAX (Serve's autoscaling, aiming at `target_ongoing_requests` per
replica).

A replica generates up to `batch` requests at once (its engine's rows), and Serve gives it at most
twice that many (`max_ongoing_requests`, by default `HELD * batch`): a row that frees takes the next
request from the replica's own queue at once, and only the requests beyond wait in Serve's router,
which sends each to a replica with room (of two replicas drawn, the one with fewer requests). With
the limit at the rows, each freed row waited for the router's retries (its backoff when every replica
is full): one replica of 16 rows under 64 clients made 49 s of audio a second where `minicpm serve`
made 107 (H100). The autoscaler aims at
half the rows busy (`target_ongoing_requests`, by default `batch / 2`), so a replica starting (tens of
seconds for a model) is not awaited by requests that already fill every row.

Importing this module imports Ray (`cluster.require_ray` says how to install it when it is missing).
"""

from __future__ import annotations

import functools
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass, fields, replace
from typing import Any

from . import cluster
from .. import protocol, trace
from ..errors import MinicpmError, OptionError, UsageError

serve = cluster.require_ray("serve").serve

APP_NAME = "minicpm"
TARGET_SHARE = 0.5  # autoscaling: more replicas when the replicas' rows are more than this busy
HELD = 2  # a replica takes this many times its rows: its rows, and a queue that refills them at once
GRACEFUL_SHUTDOWN_S = 120.0  # a replica being stopped lets its requests finish for this long


@dataclass(frozen=True)
class ServeArgs:
    """What a deployment of the speech API serves and how many replicas of it run."""

    model: str | None = None  # directory or hub repo id [default: the backend's model]
    backend: str = "auto"
    gguf: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    random_weights: bool = False
    batch: int = 0  # requests each replica generates at once (serve --batch; 0: as many as fit)
    batch_variant: bool = False  # serve --batch-variant
    api_key: str | None = None  # every request but GET /health needs it [default: each replica's MINICPM_API_KEY]
    socket_idle: float | None = protocol.SOCKET_IDLE_S  # serve --socket-idle (None: no limit)
    replicas: tuple[int, int] = (1, 1)  # (min, max): equal for a fixed number
    gpus: float | None = None  # per replica [default: 1 unless device is cpu]
    max_ongoing_requests: int | None = None  # per replica [default: HELD * batch: its rows, and as many queued]
    target_ongoing_requests: float | None = None  # autoscaling's aim per replica [default: batch * TARGET_SHARE]

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> "ServeArgs":
        """From `serve run ... key=value` pairs (strings) or a config file's `args` (typed); an unknown
        key or a value of the wrong kind is an error that names it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise OptionError(f"unknown option(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        values: dict[str, Any] = {}
        for key, value in args.items():
            if value is None or value == "":
                continue
            try:
                if key == "replicas":
                    values[key] = cluster.parse_replicas(value)
                elif key in ("random_weights", "batch_variant"):
                    values[key] = _bool(value)
                elif key in ("gpus", "target_ongoing_requests"):
                    values[key] = float(value)
                elif key in ("max_ongoing_requests", "batch"):
                    values[key] = int(value)
                else:
                    values[key] = str(value)
            except (TypeError, ValueError):
                raise OptionError(f"{key}: cannot use {value!r}") from None
        out = cls(**values)
        if out.gpus is not None and out.gpus < 0:
            raise OptionError("gpus must be at least 0")
        if out.batch < 0:
            raise OptionError("batch must be at least 1 (0: as many as fit)")
        if out.max_ongoing < 1 or not out.target_ongoing > 0:
            raise OptionError("max_ongoing_requests must be at least 1 and target_ongoing_requests positive")
        return out

    @property
    def rows(self) -> int:
        """A replica's rows as the router's limits count them: `batch`, or where each replica takes as
        many as its GPU holds (0), the most `serve` takes by default."""
        from ..engine.memory import MAX_ROWS

        return self.batch or MAX_ROWS

    @property
    def max_ongoing(self) -> int:
        return HELD * self.rows if self.max_ongoing_requests is None else self.max_ongoing_requests

    @property
    def target_ongoing(self) -> float:
        if self.target_ongoing_requests is not None:
            return self.target_ongoing_requests
        return max(1.0, self.rows * TARGET_SHARE)

    @property
    def num_gpus(self) -> float:
        if self.gpus is not None:
            return self.gpus
        return 0 if self.device == "cpu" else 1


def _cache_environment() -> dict[str, str]:
    """The compiled-kernel cache variables set here, for the replicas (`bulk.cache_environment`)."""
    from .bulk import cache_environment

    return cache_environment()


def _bool(value) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("1", "true", "yes"):
        return True
    if str(value).lower() in ("0", "false", "no"):
        return False
    raise ValueError(value)


def deployment_options(args: ServeArgs) -> dict[str, Any]:
    """Serve's options for the Speech deployment: its replicas, their GPUs, their request limits."""
    low, high = args.replicas
    actor: dict[str, Any] = {"num_gpus": args.num_gpus}
    env = _cache_environment()
    if env:
        actor["runtime_env"] = {"env_vars": env}
    opts: dict[str, Any] = {"ray_actor_options": actor, "max_ongoing_requests": args.max_ongoing,
                            "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_S}
    if low == high:
        opts["num_replicas"] = low
    else:
        opts["autoscaling_config"] = {"min_replicas": low, "initial_replicas": low, "max_replicas": high,
                                      "target_ongoing_requests": args.target_ongoing}
    return opts


# -- the replica -----------------------------------------------------------------------------------


class _ReplicaApp:
    """The ASGI application Serve's ingress holds: it passes every call to the application that this
    process's replica built. (Serve copies the ingress application into each replica before the
    replica's constructor runs, so the application, which holds the replica's model, cannot be handed
    to Serve directly; a replica is a process of its own, so there is one per process. The class is
    the holder because Serve ships `Speech` by value, with copies of the module's variables, and this
    class by reference.)"""

    app = None  # this process's replica's application (set by Speech.__init__)

    async def __call__(self, scope, receive, send):
        await _ReplicaApp.app(scope, receive, send)


@serve.deployment(name="Speech")
@serve.ingress(_ReplicaApp())
class Speech:
    """One replica: the model, loaded and warmed up before the constructor returns."""

    def __init__(self, args: ServeArgs):
        from ..serving.app import create_app
        from ..serving.service import Service, load_served

        self.service = Service(functools.partial(load_served, args.model, args.backend, args.device, args.dtype,
                                                 args.gguf, args.random_weights, args.batch, args.batch_variant),
                               socket_idle=args.socket_idle)
        settled = threading.Event()
        self.service.start(lambda loaded: settled.set(), lambda error: settled.set())
        settled.wait()
        if self.service.failure is not None:
            raise self.service.failure
        # (a key from the replica's environment, e.g. a Kubernetes secret, never enters Serve's config)
        _ReplicaApp.app = create_app(self.service, args.api_key or os.environ.get(protocol.API_KEY_ENV) or None)
        trace.mark("replica_ready", gpus=os.environ.get("CUDA_VISIBLE_DEVICES"))

    def props(self) -> dict:
        """What this replica serves (`GET /props`), for `deploy`'s ready line."""
        return self.service.props()


def app(args: dict[str, Any]):
    """The application builder: `serve run minicpm_cli.scale.ray_serve:app key=value ...`."""
    return application(ServeArgs.from_args(args))


def application(args: ServeArgs):
    return Speech.options(**deployment_options(args)).bind(args)


# -- `minicpm serve --ray` -------------------------------------------------------------------------


def deploy(args: ServeArgs, *, address: str, host: str, port: int) -> None:
    """Deploy on the cluster at `address` behind Serve's HTTP proxy at host:port, say so in one line
    once every replica is ready, serve until SIGTERM or Ctrl-C, then delete the application (its
    replicas let their requests in flight finish) and leave the cluster."""
    ray = cluster.connect(address, "serve", log_to_driver=False)  # (Serve's logs: in Ray's log directory)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if args.gpus is None and not ray.cluster_resources().get("GPU"):
            args = replace(args, gpus=0)  # (a cluster without GPUs: replicas on CPUs)
        if port == 0:
            port = _free_port(host)
        serve.start(http_options={"host": host, "port": port})
        try:
            handle = serve.run(application(args), name=APP_NAME, route_prefix="/")
        except RuntimeError as e:
            report = "\n".join([str(e), *_status_messages()])
            serve.delete(APP_NAME)  # (a failed application would stay on a cluster we leave)
            raise _failure(report) from None
        props = handle.props.remote().result()
        low, high = args.replicas
        count = f"{low} replica{'s' * (low > 1)}" if low == high else f"{low}-{high} replicas"
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        print(f"minicpm: serving {props['model']} ({props['backend']}, {props['device']}) at {url} "
              f"on Ray Serve ({count}, {args.num_gpus:g} GPUs each)", file=sys.stderr, flush=True)
        stop.wait()
        serve.delete(APP_NAME)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        cluster.disconnect()


def _free_port(host: str) -> int:
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _status_messages() -> list[str]:
    """What Serve says of the application and its deployments (a replica's traceback, when one failed)."""
    app = serve.status().applications.get(APP_NAME)
    if app is None:
        return []
    return [app.message, *(d.message for d in app.deployments.values())]


def _failure(text: str) -> MinicpmError:
    """A deployment whose replicas could not start, as one line: our own error where a replica raised
    one (the last such line of Serve's report), else the report's first line."""
    ours = re.findall(r"minicpm_cli\.errors\.\w+: (.+)", text)
    if ours:
        return MinicpmError(ours[-1].strip())
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return UsageError(f"the replicas did not start: {lines[0] if lines else 'no reason given'}")
