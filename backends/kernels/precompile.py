"""A first command's Triton kernels compiled side by side while the model loads.

With an empty Triton cache (a user's first command, or the first after an upgrade), each kernel is
compiled where the first request first launches it, one after another on the main thread: 13-17 s
on the H100 machine (docs/benchmarks.md), most of the first audio's wait. `start`, called as loading
begins (for a named backend before torch is imported), starts a thread that

1. asks the CUDA driver (ctypes; no context) for the GPU's compute capability and multiprocessors,
2. stops there if a marker says this set was compiled before (the marker's name is a hash of our
   sources, Triton's version, the GPU, the dtype, the kernel groups and the model's config.json; it
   lives in Triton's cache directory, so emptying that cache removes it too): a warm command starts
   no process,
3. else starts `python -m minicpm_cli.backends.kernels.precompile` in a process group of its own,
   which records the launches the backend's mode makes at the model's sizes (launches.py: the launch
   code on meta tensors, Triton's driver faked, nothing run), hands each to a forked worker as soon
   as it is recorded (the kernel compiled into Triton's on-disk cache, and its launcher built), then
   writes the marker (also where a kernel failed: the loading process meets that failure itself).
   Two helpers for one set (replicas starting together) take turns on a lock beside the marker.

The helper compiles what a short read runs first, then the rest (the LLM's decoding and long
prompts: `Launch.later`). Each compilation of the loading process waits for its kernel while the
helper runs (`wait_before_compiling`), then finds it in the cache; a kernel the helper did not
foresee it compiles itself, as before. The cache is Triton's own and content-addressed, and the
helper compiles each kernel from exactly what the JIT would pass (signature, constants, attributes,
options): nothing here can change what runs, only when it is compiled. The helper is a head start,
never a requirement: any failure in it is silent, and the loading process meets any real problem
itself. A command that succeeds lets its helper finish what it began (seconds; then the marker
spares the next command a helper of its own; `release`: a byte on a pipe the helper holds); one that
fails, is interrupted or killed ends it (its whole group: its workers too; it watches its parent).
Not started with fewer than MIN_CPUS usable CPUs (its workers would compile the whole set slower
than the loading process compiles what it needs); MINICPM_PRECOMPILE=0 turns it off.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ... import trace
from ...engine import warmstart
from ...engine.warmstart import cpus

ENV = "MINICPM_PRECOMPILE"
WAIT = 90.0  # seconds the loading process's compilations wait for the helper at most, in all
DEADLINE = 300.0  # seconds the helper's compiling may take before it gives up (a worker lost: no result)
MIN_CPUS = 8  # fewer usable CPUs: no helper (its few workers would compile the whole set slower than the
# loading process compiles what it needs, one after another)
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


def launch_id(module: str, name: str, jit_key: str) -> str:
    """One kernel's name in the helper's progress file: its function (module, qualified name: what
    Triton's hook names) and the JIT's key, `repr`'d (the same in the helper's recording and in the
    loading process's launch)."""
    return hashlib.sha1(f"{module}.{name}:{jit_key}".encode()).hexdigest()[:20]


class Progress:
    """The helper's progress file beside the marker, read as it grows: "P id name" a kernel planned
    (recorded), "R" the recording done, "D id" a kernel compiled with its launcher, "F id" one that
    failed. Written by one helper process (no two writers; a helper after one that was stopped writes
    a new file), read by the loading process."""

    def __init__(self, path: Path):
        self.path, self.offset, self.planned, self.done, self.recorded = path, 0, set(), set(), False
        self.inode = None

    def read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self.inode or st.st_size < self.offset:  # (a new helper's file: from its start)
                    self.inode, self.offset, self.recorded = st.st_ino, 0, False
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        data = data[: data.rfind(b"\n") + 1]  # (whole lines only: the rest is still being written)
        self.offset += len(data)
        for line in data.decode().splitlines():
            kind, _, rest = line.partition(" ")
            ident = rest.split(" ", 1)[0]
            if kind == "P":
                self.planned.add(ident)
            elif kind in ("D", "F"):  # (compiled, or failed: the loading process meets that itself)
                self.done.add(ident)
            elif kind == "R":
                self.recorded = True


class Helper:
    """The helper as seen from the loading process: a thread that asks the driver for the GPU, checks
    the marker and starts the helper process only where the marker is missing (a warm command starts
    no process), then that process."""

    def __init__(self, ordinal: int, dtype: str, groups: tuple[str, ...], model: str | None, one_row: bool = False):
        self.proc: subprocess.Popen | None = None
        self.marker: Path | None = None
        self._release_fd: int | None = None  # (our end of the pipe the helper reads its release from)
        self._args = ordinal, dtype, groups, model, one_row
        self._progress: Progress | None = None
        self._thread = threading.Thread(target=self._start, daemon=True, name="minicpm-precompile")
        self._thread.start()

    def _start(self) -> None:
        ordinal, dtype, groups, model, one_row = self._args
        try:
            with trace.span("precompile_check"):
                self._check_and_spawn(ordinal, dtype, groups, model, one_row)
        except Exception:  # (a head start only: the loading process compiles what it needs itself)
            pass

    def _check_and_spawn(self, ordinal, dtype, groups, model, one_row) -> None:
        """The GPU, the marker; the helper process where the marker is missing."""
        found = gpu(ordinal)
        if found is None:
            return
        (cc, sms), (_, raw) = found, _config(model)
        done = marker(cc, sms, dtype, groups + (("one-row",) if one_row else ()), raw)
        if done.exists():
            return
        root = str(_package().parent)  # (site-packages, or the checkout: what this process imports)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "minicpm_cli.backends.kernels.precompile", "--cc", f"{cc[0]}.{cc[1]}",
               "--sms", str(sms), "--dtype", dtype, "--groups", ",".join(groups), "--marker", str(done),
               "--parent", str(os.getpid())]
        cmd += (["--model", model] if model else []) + (["--rows", "1"] if one_row else [])
        self.marker, self._progress = done, Progress(_progress_path(done))
        read_end, self._release_fd = os.pipe()  # (a byte on it: released; its end without one: stop)
        try:
            # (run from `root`: `-m` puts the working directory first on the path, and the user's is theirs)
            self.proc = subprocess.Popen(cmd + ["--release-fd", str(read_end)], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=root,
                                         start_new_session=True, pass_fds=(read_end,))
        finally:
            os.close(read_end)
        trace.mark("precompile_spawned", helper=self.proc.pid)
        _HELPERS.append(self)
        _on_exit(_end, self)

    def release(self) -> None:
        """Let the helper finish after this process (its command succeeded): a byte on its pipe."""
        fd, self._release_fd = self._release_fd, None
        if fd is not None:
            try:
                os.write(fd, b"1")
            except OSError:  # (the helper is gone already)
                pass
            os.close(fd)

    def finished(self) -> bool:
        """The helper has nothing more to give: not started, done (its marker written) or gone."""
        if self._thread.is_alive():
            return False
        return self.proc is None or self.marker.exists() or self.proc.poll() is not None

    def running(self) -> bool:
        return not self.finished()

    def wait(self, timeout: float, ident: str | None = None) -> None:
        """Until the helper has compiled kernel `ident` (or will not: the recording is done without it),
        or (ident None) until it is finished; at most `timeout` s."""
        deadline = time.monotonic() + timeout
        self._thread.join(timeout)
        while not self.finished() and time.monotonic() < deadline:
            if ident is not None and self._progress is not None:
                self._progress.read()
                if ident in self._progress.done or (self._progress.recorded and ident not in self._progress.planned):
                    return
            time.sleep(0.01)


def start(backend: str, device: str, dtype: str, *, invariant: bool, model: str | None,
          rows: int | None = None) -> Helper | None:
    """Start the helper for `backend` on `device` (as the user gave it), where it can help: a CUDA
    device node, a backend that runs Triton kernels of ours, a dtype they compile for, CPUs enough.
    `model`: the checkpoint's directory or hub repo id (a directory's config.json sets the sizes),
    None for the full-size model (random weights); `rows` 1: a one-stream command (its batched sites
    recorded for one row only). Its process, if any, ends with this one unless `release()`d first."""
    groups = groups_for(backend, invariant)
    dt = _DTYPES.get(dtype)
    ordinal = warmstart.gpu_ordinal(device)
    if (os.environ.get(ENV, "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1" or not groups or dt is None
            or ordinal is None or cpus() < MIN_CPUS):
        return None
    if model is not None and Path(model).expanduser().exists():
        model = str(Path(model).expanduser().resolve())  # (the helper runs in another directory)
    import triton  # noqa: F401  (here, not in the thread: `marker` reads its cache directory and version)

    return Helper(ordinal, dt, groups, model, rows == 1)


def wait_before_compiling(helper: Helper, timeout: float = WAIT) -> None:
    """Make each Triton compilation of this process wait for the helper while it runs (`timeout` s at
    most in all): for the kernel itself where the helper plans it (then found in the cache), else
    not at all once the helper's recording is done (the kernel is not the helper's). Through Triton's
    hook for a kernel about to compile (`jit_cache_hook`); a hook already set is kept and called, and
    is back once the helper has finished. A Triton whose hook does not name the kernel: the whole
    helper is waited for, once."""
    try:
        from triton import knobs

        previous = knobs.runtime.jit_cache_hook
    except (ImportError, AttributeError):
        return
    deadline = time.monotonic() + timeout

    def hook(*args, **kwargs):
        fn, key = kwargs.get("fn"), kwargs.get("key")
        module, name = getattr(fn, "module", None), getattr(fn, "name", None)
        ident = launch_id(module, name, repr(key)) if module and name and key is not None else None
        if helper.running():
            with trace.span("precompile_wait", kernel=name):
                helper.wait(max(0.0, deadline - time.monotonic()), ident)
        if ident is None or helper.finished() or time.monotonic() >= deadline:
            if knobs.runtime.jit_cache_hook is hook:
                knobs.runtime.jit_cache_hook = previous
        return previous(*args, **kwargs) if previous else False

    knobs.runtime.jit_cache_hook = hook


def _progress_path(done: Path) -> Path:
    return done.with_suffix(".progress")


def _on_exit(fn, *args) -> None:
    atexit.register(fn, *args)


_HELPERS: list[Helper] = []  # (the helper processes this process started)


def release() -> None:
    """This process's command succeeded: its helpers may finish after it (each then writes its marker,
    which spares the next command a helper of its own). The CLI calls it at a command's successful end;
    at any other end (an error, an interrupt, a kill) the helpers end with this process."""
    for helper in _HELPERS:
        helper.release()


def _end(helper: Helper) -> None:
    """At this process's exit: an unreleased helper's whole group ends (its workers too)."""
    if helper._release_fd is not None and helper.proc.poll() is None:
        try:
            os.killpg(helper.proc.pid, signal.SIGTERM)
        except OSError:
            pass


def _package() -> Path:
    import minicpm_cli

    return Path(minicpm_cli.__file__).resolve().parent


def gpu(ordinal: int) -> tuple[tuple[int, int], int] | None:
    """(compute capability, multiprocessors) of device `ordinal` from the CUDA driver (no context
    made), or None."""
    try:
        found = warmstart.driver_device(ordinal)
    except OSError:
        return None
    if found is None:
        return None
    lib, dev = found
    major, minor, sms = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if (lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
            or lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)  # ..._MINOR
            or lib.cuDeviceGetAttribute(ctypes.byref(sms), 16, dev)):  # ..._MULTIPROCESSOR_COUNT
        return None
    return (major.value, minor.value), sms.value


def marker(cc: tuple[int, int], sms: int | None, dtype: str, groups: tuple[str, ...], config: bytes | None) -> Path:
    """Where the helper notes that it compiled this set: a hash of everything the set depends on. The
    loading process computes it and hands it to the helper (one computation, so one name)."""
    import triton
    from triton import knobs

    h = hashlib.sha256()
    package, backends = _package(), Path(__file__).resolve().parents[1]
    for base in [package] + ([] if backends.is_relative_to(package) else [backends]):  # (a checkout's ../backends)
        for path in sorted([*base.rglob("*.py"), *base.rglob("*.cu")]):  # (the CUDA C the helper compiles too)
            h.update(str(path.relative_to(base)).encode() + b"\0" + path.read_bytes())
    h.update(repr((triton.__version__, cc, sms, dtype, groups)).encode() + (config or b""))
    return Path(knobs.cache.dir) / "minicpm-precompiled" / h.hexdigest()[:32]  # (Triton's own cache folder)


def _config(model: str | None) -> tuple[dict | None, bytes | None]:
    """(config.json's content, its bytes) of `model` where it is a local directory; (None, None), the
    full-size model's, for random weights or a hub repo id (the official checkpoints have those sizes;
    whether it is downloaded yet does not matter, and the helper compiles while it downloads). Raises
    LookupError for a directory without one, or a name that is neither."""
    import json

    if model is None:
        return None, None
    local = Path(model).expanduser()
    if not local.exists() and not model.startswith((".", "/", "~")) and model.count("/") == 1:
        return None, None
    path = local / "config.json"
    if not path.is_file():
        raise LookupError(model)
    raw = path.read_bytes()
    return json.loads(raw), raw


def _compile(launch, cc: tuple[int, int]) -> tuple[bool, float, str]:
    """(compiled, seconds, label): one recorded launch compiled into Triton's cache (a worker's job)."""
    from .launches import compile_launch

    t = time.perf_counter()
    try:
        kernel = compile_launch(launch, cc)
    except Exception:
        return False, time.perf_counter() - t, launch.label()
    try:  # its launcher too: Triton's C stub for the signature, built by the C compiler once and cached
        from triton.runtime import driver  # (Triton 3.6: 0.3-0.4 s each on the H100 machine, 12 in a first say)

        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # (no GPU driver here: the loading process builds it, as before)
        pass
    return True, time.perf_counter() - t, launch.label()


def _compile_cuda(item: tuple, cc: tuple[int, int]) -> tuple[bool, float, str]:
    """(compiled, seconds, label): one recorded CUDA C kernel (file, kernel, constants) compiled by
    NVRTC into backends/cuda.py's disk cache (a worker's job; the loading process reads it there)."""
    from .. import cuda

    file, name, defines = item
    label = f"{name}(" + ",".join(f"{k}={v}" for k, v in defines) + ")"
    t = time.perf_counter()
    try:
        cuda.cubin(file, name, f"{cc[0]}{cc[1]}", defines)
    except Exception as e:
        return False, time.perf_counter() - t, f"{label}: {' '.join(str(e).split())[:300]}"
    return True, time.perf_counter() - t, label


def _watch(parent: int, release_fd: int | None) -> None:
    """End this process's group (the helper and its workers) once `parent` has gone, unless it
    released the helper first (a byte on `release_fd`, `Helper.release`): an interrupted command
    leaves through os._exit, without its atexit functions, and leaves nothing running behind it."""
    def loop():
        while os.getppid() == parent:
            time.sleep(0.2)
        if not _released(release_fd):
            os.killpg(0, signal.SIGTERM)

    threading.Thread(target=loop, daemon=True, name="minicpm-precompile-watch").start()


def _released(fd: int | None) -> bool:
    """Whether the parent wrote its release on `fd` (it stays in the pipe after the parent's end)."""
    if fd is None:
        return False
    try:
        os.set_blocking(fd, False)
        return os.read(fd, 1) == b"1"
    except OSError:  # (nothing written: BlockingIOError where another process still holds the pipe open)
        return False


def run(cc: tuple[int, int], sms: int | None, dtype: str, groups: tuple[str, ...], model: str | None,
        jobs: int, done: Path | None = None, rows: tuple[int, ...] | None = None) -> dict:
    """Record and compile (the helper's work) -> what it did. `done`: the marker (default: computed
    here). Two helpers for one set take turns (a lock beside the marker): the second finds it done."""
    import fcntl

    t0 = time.perf_counter()
    config, raw = _config(model)
    done = done or marker(cc, sms, dtype, groups + (("one-row",) if rows == (1,) else ()), raw)
    done.parent.mkdir(parents=True, exist_ok=True)
    with open(done.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return {"compiled": 0, "failed": 0, "skipped": True, "marker": str(done)}
        from . import launches

        return _run(cc, sms, dtype, groups, config, jobs, done, t0, rows or launches.ROWS)


class Order:
    """The helper's order of compilation: each launch handed to `submit(ident, launch)` as it is
    recorded, except those a short request does not run (`Launch.later`), held until `flush()`; a
    held launch recorded again for a short request goes at once. `note(line)` gets "P id name" once
    a kernel."""

    def __init__(self, submit, note):
        self.submit, self.note, self.held = submit, note, {}

    def found(self, launch) -> None:
        ident = launch_id(launch.module, launch.qualname, launch.jit_key)
        again = self.held.pop(ident, None) is not None
        if launch.later:
            self.held[ident] = launch
        else:
            self.submit(ident, launch)
        if not again:
            self.note(f"P {ident} {launch.name}")

    def flush(self) -> None:
        for ident, launch in self.held.items():
            self.submit(ident, launch)
        self.held = {}


def _run(cc, sms, dtype, groups, config, jobs, done: Path, t0: float, rows) -> dict:
    import multiprocessing

    from triton.runtime.cache import triton_key

    from . import launches

    with trace.span("precompile_import"):
        launches.import_sites()  # (torch, Triton, the kernels' modules: the forked workers inherit them)
        triton_key()  # (Triton's hash of itself, 0.4 s, cached: once here instead of once a worker)
    # forked workers: this process has made no CUDA context, and its one thread besides this one only
    # sleeps (`_watch`); a spawned worker would import torch again (seconds). Each launch is compiled
    # as soon as it is recorded, those a short request does not run (`Launch.later`) after the rest
    _progress_path(done).unlink(missing_ok=True)  # (a new file: a reader of a stopped helper's starts over)
    progress = open(_progress_path(done), "w", buffering=1)  # (line-buffered: each line as it happens)

    def note(line: str) -> None:
        progress.write(line + "\n")

    def submit(ident: str, launch) -> None:
        pending.append(pool.apply_async(_compile, (launch, cc), callback=lambda r: note(f"{'D' if r[0] else 'F'} {ident}")))

    with multiprocessing.get_context("fork").Pool(max(1, jobs)) as pool, progress:
        pending = []
        order = Order(submit, note)
        with trace.span("precompile_record"):
            recorded, cuda_kernels = launches.record(cc, (dtype,), groups, config, sms, found=order.found, rows=rows)
        order.flush()
        for item in cuda_kernels:  # (NVRTC's: no Triton kernel waits for them, so last)
            pending.append(pool.apply_async(_compile_cuda, (item, cc)))
        note("R")
        t_rec = time.perf_counter() - t0
        results, lost = [], 0
        with trace.span("precompile_compile", kernels=len(recorded) + len(cuda_kernels)):
            for p in pending:
                try:
                    results.append(p.get(max(0.0, t0 + DEADLINE - time.perf_counter())))
                except multiprocessing.TimeoutError:  # (a worker lost, or a compilation that never ends)
                    lost += 1
        failed = [label for ok, _, label in results if not ok]
        # (written whatever failed: a kernel that does not compile here does not in the loading process
        # either, which falls back loudly (kernels/fallback.py); later commands must not wait for it
        # again. Before the pool's teardown: the loading process waits for the marker, not the exit)
        done.write_text(f"{len(recorded) + len(cuda_kernels)} kernels, sm_{cc[0]}{cc[1]}, {dtype}, {','.join(groups)}; "
                        f"{len(failed)} failed, {lost} lost\n")
    slowest = sorted(results, key=lambda r: -r[1])[:5]
    return {"compiled": len(recorded) + len(cuda_kernels), "failed": len(failed) + lost, "failures": failed, "skipped": False,
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
    p.add_argument("--marker", help="the marker to write (default: computed here)")
    p.add_argument("--parent", type=int, help="end when this process has gone (unless it released us)")
    p.add_argument("--release-fd", type=int, help="a pipe on which the parent writes its release")
    p.add_argument("--rows", type=int, help="1: a one-stream command's kernels (batched sites at one row)")
    p.add_argument("--jobs", type=int, default=max(1, cpus() - 2))
    p.add_argument("--verbose", action="store_true", help="say what was done on stderr")
    a = p.parse_args(argv)
    trace.mark("precompile_exec")  # (the helper's process is up: Python, this module, no torch yet)
    if a.parent is not None:
        _watch(a.parent, a.release_fd)
    found = ((tuple(int(x) for x in a.cc.split(".")), a.sms) if a.cc else gpu(a.ordinal))
    if found is None:
        return 1
    try:
        out = run(*found, a.dtype, tuple(a.groups.split(",")), a.model, a.jobs, Path(a.marker) if a.marker else None,
                  (1,) if a.rows == 1 else None)
    except LookupError:
        return 1
    if a.verbose:
        print(out, file=sys.stderr)
    return 1 if out["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
