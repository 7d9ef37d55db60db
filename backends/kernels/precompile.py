"""A first command's Triton kernels compiled side by side while the model loads.

With an empty Triton cache (a user's first command, or the first after an upgrade), each kernel is
compiled where the first request first launches it, one after another on the main thread: 13-17 s
on the H100 machine (docs/benchmarks.md), most of the first audio's wait. `start`, called as loading
begins (before torch is imported), starts a thread that

1. asks the CUDA driver (ctypes; no context) for the GPU's compute capability and multiprocessors,
2. stops there if a marker says this set was compiled before (the marker's name is a hash of our
   sources, Triton's version, the GPU, the dtype, the kernel groups and the model's config.json; it
   lives in Triton's cache directory, so emptying that cache removes it too): a warm command starts
   no process,
3. else starts `python -m minicpm_cli.backends.kernels.precompile` in a process group of its own,
   which records the launches the backend's mode makes at the model's sizes (launches.py: the launch
   code on meta tensors, Triton's driver faked, nothing run), hands each to a forked worker as soon
   as it is recorded (the kernel compiled into Triton's on-disk cache, and its launcher built), then
   writes the marker.

The loading process's first compilation waits for the helper (`wait_before_compiling`), then finds
each kernel in the cache; a kernel the helper did not foresee it compiles itself, as before. The
cache is Triton's own and content-addressed, and the helper compiles each kernel from exactly what
the JIT would pass (signature, constants, attributes, options): nothing here can change what runs,
only when it is compiled. The helper is a head start, never a requirement: any failure in it is
silent, and the loading process meets any real problem itself. It ends with the process that
started it (its whole group: its workers too). MINICPM_PRECOMPILE=0 turns it off.
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
import threading
import time
from pathlib import Path

from ... import trace

ENV = "MINICPM_PRECOMPILE"
WAIT = 90.0  # seconds a first compilation waits for the helper at most
_GPU = re.compile(r"^(auto|cuda(:\d+)?)$")
_DTYPES = {"auto": "bfloat16", "bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}


def groups_for(backend: str, invariant: bool) -> tuple[str, ...]:
    """launches.GROUPS a backend runs in a mode (batch-invariant or not); () where it runs no Triton
    kernel of ours."""
    tts = ("tts-invariant", "tts") if invariant else ("tts-single", "tts")
    if backend == "compile":
        return ("llm-invariant",) + tts if invariant else ("llm-variant",) + tts
    if backend == "int4":
        return ("llm-invariant", "int4-invariant") + tts if invariant else ("int4-variant",) + tts
    if backend == "gguf":
        return tts
    return ()


class Helper:
    """The helper as seen from the loading process: a thread that asks the driver for the GPU, checks
    the marker and starts the helper process only where the marker is missing (a warm command starts
    no process), then that process."""

    def __init__(self, ordinal: int, dtype: str, groups: tuple[str, ...], model: str | None):
        self.proc: subprocess.Popen | None = None
        self._args = ordinal, dtype, groups, model
        self._thread = threading.Thread(target=self._start, daemon=True, name="minicpm-precompile")
        self._thread.start()

    def _start(self) -> None:
        ordinal, dtype, groups, model = self._args
        try:
            found = gpu(ordinal)
            if found is None:
                return
            (cc, sms), (_, raw) = found, _config(model)
            if marker(cc, sms, dtype, groups, raw).exists():
                return
            root = str(_package().parent)  # (site-packages, or the checkout: where the helper imports from)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
            cmd = [sys.executable, "-m", "minicpm_cli.backends.kernels.precompile", "--cc", f"{cc[0]}.{cc[1]}",
                   "--sms", str(sms), "--dtype", dtype, "--groups", ",".join(groups)]
            cmd += ["--model", model] if model else []
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, env=env, start_new_session=True)
            atexit.register(_end, self.proc)
        except Exception:  # (a head start only: the loading process compiles what it needs itself)
            pass

    def wait(self, timeout: float) -> None:
        """Until the helper is done (or `timeout` s have passed)."""
        deadline = time.monotonic() + timeout
        self._thread.join(timeout)
        if self.proc is not None:
            try:
                self.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    def running(self) -> bool:
        return self._thread.is_alive() or (self.proc is not None and self.proc.poll() is None)


def start(backend: str, device: str, dtype: str, *, invariant: bool, model: str | None) -> Helper | None:
    """Start the helper for `backend` on `device` (as the user gave it), where it can help: a CUDA
    device node, a backend that runs Triton kernels of ours, a dtype they compile for. `model`: the
    checkpoint's directory or hub repo id (its config.json sets the sizes), None for the full-size
    model (random weights). Its process, if any, ends when this one exits."""
    groups = groups_for(backend, invariant)
    dt = _DTYPES.get(dtype)
    if (os.environ.get(ENV, "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1" or not groups or dt is None
            or not _GPU.match(device) or not os.path.exists("/dev/nvidiactl")):
        return None
    return Helper(int(device[5:]) if device.startswith("cuda:") else 0, dt, groups, model)


def wait_before_compiling(helper: Helper, timeout: float = WAIT) -> None:
    """Make this process's first Triton compilation wait for the helper (up to `timeout` s): what it
    would compile then is the helper's work, already under way side by side, and found in the cache
    once the helper is done. Through Triton's hook for a kernel about to compile (`jit_cache_hook`),
    once; a hook already set is kept and called."""
    try:
        from triton import knobs

        previous = knobs.runtime.jit_cache_hook
    except (ImportError, AttributeError):
        return

    def hook(*args, **kwargs):
        if knobs.runtime.jit_cache_hook is hook:
            knobs.runtime.jit_cache_hook = previous
        if helper.running():
            with trace.span("precompile_wait"):
                helper.wait(timeout)
        return previous(*args, **kwargs) if previous else False

    knobs.runtime.jit_cache_hook = hook


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except OSError:
            pass


def _package() -> Path:
    import minicpm_cli

    return Path(minicpm_cli.__file__).resolve().parent


def gpu(ordinal: int) -> tuple[tuple[int, int], int] | None:
    """(compute capability, multiprocessors) of device `ordinal` from the CUDA driver (no context
    made), or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, major, minor, sms = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if (lib.cuInit(0) or lib.cuDeviceGet(ctypes.byref(dev), ordinal)
            or lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
            or lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)  # ..._MINOR
            or lib.cuDeviceGetAttribute(ctypes.byref(sms), 16, dev)):  # ..._MULTIPROCESSOR_COUNT
        return None
    return (major.value, minor.value), sms.value


def triton_cache() -> Path:
    """Triton's cache directory, as Triton finds it (TRITON_CACHE_DIR, else TRITON_HOME or ~, .triton/cache)."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    return Path(os.environ.get("TRITON_HOME") or Path.home()) / ".triton" / "cache"


def marker(cc: tuple[int, int], sms: int | None, dtype: str, groups: tuple[str, ...], config: bytes | None) -> Path:
    """Where the helper notes that it compiled this set: a hash of everything the set depends on."""
    from importlib import metadata

    h = hashlib.sha256()
    package, backends = _package(), Path(__file__).resolve().parents[1]
    for base in [package] + ([] if backends.is_relative_to(package) else [backends]):  # (a checkout's ../backends)
        for path in sorted(base.rglob("*.py")):
            h.update(str(path.relative_to(base)).encode() + b"\0" + path.read_bytes())
    triton = sys.modules.get("triton")  # (imported by now on a GPU: engine/warmstart.py)
    try:
        h.update((triton.__version__ if triton else metadata.version("triton")).encode())
    except metadata.PackageNotFoundError:
        pass
    h.update(repr((cc, sms, dtype, groups)).encode() + (config or b""))
    return triton_cache() / "minicpm-precompiled" / h.hexdigest()[:32]


def _config(model: str | None) -> tuple[dict | None, bytes | None]:
    """(config.json's content, its bytes) of `model`: a directory's, or a hub repo id's from the local
    cache; (None, None), the full-size model's, for random weights or a repo id not downloaded yet (a
    first command: the helper compiles while the download runs; the official checkpoints have those
    sizes). Raises LookupError for a directory without one."""
    import json

    if model is None:
        return None, None
    local = Path(model).expanduser()
    path = local / "config.json"
    if not path.is_file():
        if local.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
            raise LookupError(model)
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(model, "config.json")
        except Exception:
            found = None
        if not isinstance(found, str):
            return None, None
        path = Path(found)
    raw = path.read_bytes()
    return json.loads(raw), raw


def _compile(launch, cc: tuple[int, int]) -> tuple[bool, float, str]:
    """(compiled, seconds, label): one recorded launch compiled into Triton's cache (a worker's job)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    t = time.perf_counter()
    signature, constexprs, attrs, options = launch.raw  # (as the JIT will pass them: the same cache key)
    try:
        fn = getattr(importlib.import_module(launch.module), launch.name)
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                target=GPUTarget("cuda", cc[0] * 10 + cc[1], 32), options=options)
    except Exception:
        return False, time.perf_counter() - t, launch.label()
    try:  # its launcher too: Triton's C stub for the signature, built by the C compiler once and cached
        from triton.runtime import driver  # (Triton 3.6: 0.3-0.4 s each on the H100 machine, 12 in a first say)

        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # (no GPU driver here: the loading process builds it, as before)
        pass
    return True, time.perf_counter() - t, launch.label()


def run(cc: tuple[int, int], sms: int | None, dtype: str, groups: tuple[str, ...], model: str | None,
        jobs: int) -> dict:
    """Record and compile (the helper's work, also callable in-process) -> what it did."""
    t0 = time.perf_counter()
    config, raw = _config(model)
    done = marker(cc, sms, dtype, groups, raw)
    if done.exists():
        return {"compiled": 0, "failed": 0, "skipped": True, "marker": str(done)}
    from . import launches  # (torch, Triton and the kernels' modules imported: the workers inherit them)

    # forked workers: this process has made no CUDA context and no thread of its own yet (a spawned
    # worker would import torch again: seconds); each launch is compiled as soon as it is recorded
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(max(1, jobs)) as pool:
        pending = []
        with trace.span("precompile_record"):
            recorded, _ = launches.record(cc, (dtype,), groups, config, sms,
                                          found=lambda launch: pending.append(pool.apply_async(_compile, (launch, cc))))
        t_rec = time.perf_counter() - t0
        with trace.span("precompile_compile", kernels=len(recorded)):
            results = [p.get() for p in pending]
    failed = [label for ok, _, label in results if not ok]
    if not failed:
        done.parent.mkdir(parents=True, exist_ok=True)
        done.write_text(f"{len(recorded)} kernels, sm_{cc[0]}{cc[1]}, {dtype}, {','.join(groups)}\n")
    slowest = sorted(results, key=lambda r: -r[1])[:5]
    return {"compiled": len(recorded), "failed": len(failed), "failures": failed, "skipped": False,
            "marker": str(done), "record_seconds": round(t_rec, 2), "seconds": round(time.perf_counter() - t0, 2),
            "compile_seconds": round(sum(r[1] for r in results), 2),
            "slowest": [(label, round(t, 2)) for _, t, label in slowest]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ordinal", type=int, default=0)
    p.add_argument("--cc", help="compile for this capability (e.g. 9.0) instead of the device's")
    p.add_argument("--sms", type=int, help="with --cc: its multiprocessors (default: the representative card's)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(set(_DTYPES.values())))
    p.add_argument("--groups", required=True)
    p.add_argument("--model", help="a checkpoint directory or hub repo id (default: the full-size model)")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    p.add_argument("--verbose", action="store_true", help="say what was done on stderr")
    a = p.parse_args(argv)
    found = ((tuple(int(x) for x in a.cc.split(".")), a.sms) if a.cc else gpu(a.ordinal))
    if found is None:
        return 1
    try:
        out = run(*found, a.dtype, tuple(a.groups.split(",")), a.model, a.jobs)
    except LookupError:
        return 1
    if a.verbose:
        print(out, file=sys.stderr)
    return 1 if out["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
