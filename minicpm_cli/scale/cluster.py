"""Ray, imported only when a command asks for it, and the cluster a command runs on.

`require_ray()` imports Ray (and the parts of it a command names) or raises one error that says which
extra installs it. Nothing imports Ray at module level but `ray_serve`, which only `serve --ray` (and
Ray Serve itself) imports, so `bulk` and `serve` without `--ray` and every other command work without
the extra. `connect(address)` joins a
cluster: `auto` finds one as `ray.init()` does (RAY_ADDRESS, else a cluster started on this machine
with `ray start --head`, else a new local Ray that ends with the command), any other value is the
address of a running cluster (`HOST:6379` from one of its nodes, `ray://HOST:10001` through Ray
Client). Ray's own progress bars and log lines stay off our stderr unless they are warnings.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys

from ..errors import OptionError, UsageError

AUTO = "auto"
EXTRA = "pip install 'minicpm-cli[ray]'"
# what an address looks like: HOST:PORT, or a scheme such as ray:// (Ray Client) or anyscale://
_ADDRESS = re.compile(r"^([a-z][a-z0-9+.-]*://)?[^\s/:]+(:\d+)?$|^[a-z][a-z0-9+.-]*://\S+$")


def quiet_ray() -> None:
    """Keep what Ray says on every run, and is not ours to report, off our stderr."""
    # the notice that its token authentication is on (it is the default)
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)


def require_ray(*parts: str):
    """`ray` (and `ray.<part>` for each of `parts`, e.g. "data", "serve"), or a UsageError saying how
    to install it."""
    if "ray" not in sys.modules:
        # nothing joins a new Ray once we leave ours: Serve's handle thread, still running at the end of
        # `serve --ray`, started one from outside the main thread ("SIGTERM handler is not set"); Ray
        # reads this once, when it is imported
        os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
    try:
        ray = importlib.import_module("ray")
        for part in parts:
            importlib.import_module(f"ray.{part}")
    except ImportError as e:
        raise UsageError(f"--ray needs Ray ({e.name or 'ray'} is not installed): {EXTRA}") from None
    return ray


def parse_replicas(value) -> tuple[int, int]:
    """`N` or `MIN-MAX` (or an int N) -> (min, max); a ValueError unless 1 <= MIN <= MAX."""
    low, sep, high = str(value).partition("-")
    bounds = (int(low), int(high) if sep else int(low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"not 1 <= MIN <= MAX: {value}")
    return bounds


def check_address(address: str) -> str:
    """`auto`, or something shaped like a cluster address (so `--ray items.txt`, a value swallowed by
    the option, is an error here and not a connection attempt)."""
    if address == AUTO or (":" in address and _ADDRESS.match(address)):
        return address
    raise OptionError(f"--ray takes 'auto' or a cluster address such as HOST:6379 or ray://HOST:10001, "
                      f"not '{address}'")


def connect(address: str, *parts: str, log_to_driver: bool = True):
    """Join the cluster at `address` (see the module's docstring); returns the `ray` module.
    `log_to_driver`: the output of this job's actors comes to our stderr (with Ray's prefix)."""
    ray = require_ray(*parts)
    if ray.is_initialized():
        return ray
    quiet_ray()
    ray.init(address=None if address == AUTO else address, logging_level=logging.WARNING,
             configure_logging=True, log_to_driver=log_to_driver, include_dashboard=False)
    if "serve" in parts:
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    if "data" in parts:
        ray.data.DataContext.get_current().enable_progress_bars = False  # (ours counts items and audio seconds)
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # ("progress bars disabled")
    return ray


def disconnect() -> None:
    """Leave the cluster (a local Ray this command started ends with it)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
