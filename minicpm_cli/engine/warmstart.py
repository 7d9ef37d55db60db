"""Work that loading a model on a GPU can start before torch is imported, on daemon threads that hold
the GIL little: importing torch takes 1-3 s of one core, and both of these would otherwise wait for it
on the main thread.

- The CUDA driver and the device's primary context (`cuInit`, `cuDevicePrimaryCtxRetain`, through
  ctypes): torch uses that same context, so its own initialisation then finds it made.
- Triton's own cache key (`triton_key`: a SHA-256 of its ~500 MB library and sources, cached for the
  process; 0.43 s on the H100 machine, 1.4 s on the 2-core CPU one), which the first kernel launch
  computes, otherwise inside the first request. Triton and the packages the key walks are imported
  first, on the calling thread (the loader imports Triton anyway; the walk adds about 2 ms), so that
  the thread itself only reads and hashes: no import of its could meet the main thread's (torch's,
  ours) in a module lock.

Taken only where a CUDA device node exists, the device asked for is `auto` or CUDA and torch is not
imported yet; the key only for a backend that runs Triton kernels (compile, int4) or may (`auto`
without --gguf). Nothing here changes what is loaded or computed: a failure is
ignored (the main thread then does the same work itself, as before).

Measured (one-shot `say`, compile, H100, warm caches, exec -> first audio byte): median 5.28 -> 4.61
s (docs/benchmarks.md). Tried and dropped: asking the page cache for the checkpoint's tensors
(`posix_fadvise(WILLNEED)`) while torch imports; from a dropped page cache the first audio came no
sooner (15.4-15.6 s against 14.4-15.6), the tensors taking 8.2-8.8 s either way.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import sysconfig
import threading

_GPU = re.compile(r"^(auto|cuda(:\d+)?)$")


def begin(triton: bool, device: str) -> None:
    """Start the threads before loading on `device` (as the user gave it: "auto", "cuda", "cuda:N";
    anything else starts nothing); `triton`: the backend runs Triton kernels (or may: `auto`). Not
    where torch is already imported (nothing left to overlap: a server's second load, tests)."""
    ordinal = gpu_ordinal(device)
    if "torch" in sys.modules or ordinal is None:
        return
    threading.Thread(target=_quietly, args=(cuda_context, ordinal), daemon=True, name="minicpm-cuda").start()
    if not triton:
        return
    try:
        key = _import_triton()
    except Exception:
        return
    threading.Thread(target=_quietly, args=(key,), daemon=True, name="minicpm-triton-key").start()


def gpu_ordinal(device: str) -> int | None:
    """The CUDA device `device` (as the user gave it) names where this machine has a CUDA device
    node: 0 for "auto" and "cuda", N for "cuda:N"; None for anything else (a CPU, no GPU here)."""
    if not _GPU.match(device) or not gpu_node():
        return None
    return int(device[5:]) if device.startswith("cuda:") else 0


def cpus() -> int:
    """CPUs this process may run on (its affinity, where the system tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def gpu_node() -> bool:
    return os.path.exists("/dev/nvidiactl")


def driver_device(ordinal: int):
    """(the CUDA driver's library, device `ordinal`'s handle), the driver initialised; None where
    either fails."""
    lib = ctypes.CDLL("libcuda.so.1")
    dev = ctypes.c_int()
    if lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
        return None
    return lib, dev


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # (only a head start: the main thread meets any real problem itself)
        pass


def cuda_context(ordinal: int) -> bool:
    """Initialise the driver and retain device `ordinal`'s primary context (the one torch uses; kept
    for the process, as torch keeps it) -> whether it was made. Modules load lazily, as torch asks
    of the driver before its own first call."""
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    found = driver_device(ordinal)
    if found is None:
        return False
    lib, dev = found
    ctx = ctypes.c_void_p()
    return lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0


def _import_triton():
    """Triton's key function, with every package it will walk (`pkgutil.walk_packages` imports
    packages) imported here, on the calling thread."""
    import pkgutil

    import triton
    from triton.runtime.cache import triton_key

    sysconfig.get_config_var("EXT_SUFFIX")  # (the key reads it; its first call imports a module)
    base = os.path.dirname(triton.__file__)
    for sub in ("compiler", "backends", "language"):
        for _ in pkgutil.walk_packages([os.path.join(base, sub)], prefix=f"triton.{sub}."):
            pass
    return triton_key
