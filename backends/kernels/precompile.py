"""A first command's Triton kernels compiled side by side while the model loads.

With an empty Triton cache (a user's first command, or the first after an upgrade), each kernel is
compiled where the first request first launches it, one after another on the main thread: 10-14 s
on an H100 machine (docs/benchmarks.md), most of the first audio's wait. `start`, called as loading
begins (before torch is imported), starts `python -m minicpm_cli.backends.kernels.precompile` in a
process group of its own. That process

1. finds the GPU's compute capability (the CUDA driver through ctypes; no context),
2. stops at once if a marker says it compiled this set before (the marker's name is a hash of our
   sources, Triton's and torch's versions, the capability, the dtype, the groups and the model's
   config.json; it lives in Triton's cache directory, so emptying that cache removes it too),
3. records the launches the backend's mode makes at the model's sizes (launches.py: the launch code
   on meta tensors, Triton's driver faked, nothing run), in the order a request first makes them,
4. compiles them in forked worker processes into Triton's on-disk cache, then writes the marker.

The loading process finds each kernel there when it first launches it, or compiles it itself as
before if it gets there first: the cache is Triton's own and content-addressed, so nothing here can
change what runs, only when it is compiled. The helper is a head start, never a requirement: any
failure in it is silent, and the main process meets any real problem itself. It ends with the
process that started it (its whole group: its workers too). MINICPM_PRECOMPILE=0 turns it off.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ENV = "MINICPM_PRECOMPILE"
_GPU = re.compile(r"^(auto|cuda(:\d+)?)$")
_DTYPES = {"auto": "bfloat16", "bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}


def groups_for(backend: str, invariant: bool) -> tuple[str, ...]:
    """launches.GROUPS a backend runs in a mode (batch-invariant or not); () where it runs no Triton
    kernel of ours."""
    tts = ("tts-invariant", "tts") if invariant else ("tts",)
    if backend == "compile":
        return ("llm-invariant",) + tts if invariant else ("llm-variant",) + tts
    if backend == "int4":
        return ("llm-invariant", "int4-invariant") + tts if invariant else ("int4-variant",) + tts
    if backend == "gguf":
        return tts
    return ()


def start(backend: str, device: str, dtype: str, *, invariant: bool, model: str | None) -> subprocess.Popen | None:
    """Start the helper for `backend` on `device` (as the user gave it), where it can help: a CUDA
    device node, a backend that runs Triton kernels of ours, a dtype they compile for. `model`: the
    checkpoint's directory or hub repo id (its config.json sets the sizes), None for the full-size
    model (random weights). Returns the process (ended when this one exits), or None."""
    groups = groups_for(backend, invariant)
    dt = _DTYPES.get(dtype)
    if (os.environ.get(ENV, "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1" or not groups or dt is None
            or not _GPU.match(device) or not os.path.exists("/dev/nvidiactl")):
        return None
    ordinal = int(device[5:]) if device.startswith("cuda:") else 0
    root = str(_package().parent)  # (site-packages, or the checkout: where the helper's imports come from)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "minicpm_cli.backends.kernels.precompile", "--ordinal", str(ordinal),
           "--dtype", dt, "--groups", ",".join(groups)] + (["--model", model] if model else [])
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    except OSError:
        return None
    atexit.register(_end, proc)
    return proc


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except OSError:
            pass


def _package() -> Path:
    import minicpm_cli

    return Path(minicpm_cli.__file__).resolve().parent


def capability(ordinal: int) -> tuple[int, int] | None:
    """Device `ordinal`'s compute capability from the CUDA driver (no context made), or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if (lib.cuInit(0) or lib.cuDeviceGet(ctypes.byref(dev), ordinal)
            or lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
            or lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)):  # ..._MINOR
        return None
    return major.value, minor.value


def triton_cache() -> Path:
    """Triton's cache directory, as Triton finds it (TRITON_CACHE_DIR, else TRITON_HOME or ~, .triton/cache)."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    return Path(os.environ.get("TRITON_HOME") or Path.home()) / ".triton" / "cache"


def marker(cc: tuple[int, int], dtype: str, groups: tuple[str, ...], config: bytes | None) -> Path:
    """Where the helper notes that it compiled this set: a hash of everything the set depends on."""
    from importlib import metadata

    h = hashlib.sha256()
    package, backends = _package(), Path(__file__).resolve().parents[1]
    for base in [package] + ([] if backends.is_relative_to(package) else [backends]):  # (a checkout's ../backends)
        for path in sorted(base.rglob("*.py")):
            h.update(str(path.relative_to(base)).encode() + b"\0" + path.read_bytes())
    for dist in ("triton", "torch"):
        try:
            h.update(metadata.version(dist).encode())
        except metadata.PackageNotFoundError:
            pass
    h.update(repr((cc, dtype, groups)).encode() + (config or b""))
    return triton_cache() / "minicpm-precompiled" / h.hexdigest()[:32]


def _config(model: str | None) -> tuple[dict | None, bytes | None]:
    """(config.json's content, its bytes) of `model`: a directory, or a hub repo id already in the local
    cache (nothing is downloaded here); (None, None) for the full-size model. Raises LookupError where
    there is none."""
    import json

    if model is None:
        return None, None
    path = Path(model).expanduser() / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(model, "config.json")
        except Exception:
            found = None
        if not isinstance(found, str):
            raise LookupError(model)
        path = Path(found)
    raw = path.read_bytes()
    return json.loads(raw), raw


def _compile(launch, cc: tuple[int, int]) -> bool:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch.module), launch.name)
    src = ASTSource(fn, dict(launch.signature), dict(launch.constexprs), dict(launch.attrs))
    try:
        triton.compile(src, target=GPUTarget("cuda", cc[0] * 10 + cc[1], 32), options=dict(launch.options))
    except Exception:
        return False
    return True


def _job(args) -> bool:
    return _compile(*args)


def run(cc: tuple[int, int], dtype: str, groups: tuple[str, ...], model: str | None, jobs: int) -> dict:
    """Record and compile (the helper's work, also callable in-process) -> what it did."""
    from ... import trace

    t0 = time.perf_counter()
    config, raw = _config(model)
    done = marker(cc, dtype, groups, raw)
    if done.exists():
        return {"compiled": 0, "failed": 0, "skipped": True, "marker": str(done)}
    from . import launches

    with trace.span("precompile_record"):
        found, _ = launches.record(cc, (dtype,), groups, config)
    recorded = time.perf_counter() - t0
    # forked workers: this process has imported torch but made no CUDA context, and forks before any
    # thread of its own (a spawned worker would import torch again: seconds)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with trace.span("precompile_compile", kernels=len(found)):
        with ProcessPoolExecutor(max_workers=max(1, min(jobs, len(found))),
                                 mp_context=multiprocessing.get_context("fork")) as pool:
            ok = list(pool.map(_job, [(launch, cc) for launch in found], chunksize=1))
    failed = ok.count(False)
    if not failed:
        done.parent.mkdir(parents=True, exist_ok=True)
        done.write_text(f"{len(found)} kernels, sm_{cc[0]}{cc[1]}, {dtype}, {','.join(groups)}\n")
    return {"compiled": len(found), "failed": failed, "skipped": False, "marker": str(done),
            "record_seconds": recorded, "seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ordinal", type=int, default=0)
    p.add_argument("--cc", help="compile for this capability (e.g. 9.0) instead of the device's")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(set(_DTYPES.values())))
    p.add_argument("--groups", required=True)
    p.add_argument("--model", help="a checkpoint directory or hub repo id (default: the full-size model)")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    p.add_argument("--verbose", action="store_true", help="say what was done on stderr")
    a = p.parse_args(argv)
    cc = tuple(int(x) for x in a.cc.split(".")) if a.cc else capability(a.ordinal)
    if cc is None:
        return 1
    try:
        out = run(cc, a.dtype, tuple(a.groups.split(",")), a.model, a.jobs)
    except LookupError:
        return 1
    if a.verbose:
        print(out, file=sys.stderr)
    return 1 if out["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
