"""`minicpm bench --startup`: what a one-shot `minicpm say` costs from exec to its last byte.

Each measurement is a fresh process, `minicpm say TEXT -o - --backend B --model DIR`, timed from the
parent (exec, first audio byte on the pipe, exit) and from inside (the phases it writes to
$MINICPM_STARTUP_LOG, `trace.py`): imports, tensor reads and host-to-device copies (with the bytes
moved), weight preparation (fusing, packing), and during the first request the JIT compilation that
the first run of a step triggers (Triton, torch.compile, NVRTC) and the CUDA-graph captures. Per
backend, a first run with empty compilation caches and a second run with the caches the first one
filled, as a user's first and every later command; the caches live in a temporary folder so the
user's own stay untouched. The page cache is not dropped: a checkpoint read once is read from memory
afterwards, which is stated above the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError

TEXT = "Hi, how are you?"


@dataclass
class Run:
    backend: str
    which: str  # "first" (empty caches) or "second"
    exit_code: int
    exec_to_start: float  # interpreter start, until our entry point runs
    imports: float  # entry point -> the model code imported
    tensors: float  # reading tensors and copying them to the device (summed)
    gbytes: float
    prepare: float  # fusing / packing weights
    loaded: float  # exec -> model loaded
    jit: float  # first runs of steps before their capture (compilation), summed
    captures: float  # CUDA-graph captures, summed
    nvrtc: float
    first_byte: float  # exec -> first audio byte on stdout
    done: float  # exec -> exit
    error: str = ""
    spans: dict[str, float] = field(default_factory=dict)  # every phase the process noted, summed
    helper_done: float = float("nan")  # exec -> the precompile helper's last kernel compiled (none: nan)


def _measure(backend: str, which: str, model: str, cache: Path, device: str) -> Run:
    log = cache / f"{backend}-{which}.jsonl"
    log.unlink(missing_ok=True)
    env = {**os.environ, "MINICPM_STARTUP_LOG": str(log), "TRITON_CACHE_DIR": str(cache / "triton"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "MINICPM_CACHE_DIR": str(cache / "minicpm"),
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "minicpm_cli", "say", TEXT, "-o", "-", "--local", "--backend", backend,
           "--model", model, "--device", device]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = _first_sample(proc.stdout)
    t_first = time.time()
    proc.stdout.read()
    err = proc.stderr.read().decode(errors="replace")
    code = proc.wait()
    t_done = time.time()
    _await_helper(log)
    events, spans = {}, {}
    if log.exists():
        for line in log.read_text().splitlines():
            r = json.loads(line)
            if "event" in r:
                events.setdefault(r["event"], r["t"])
            else:
                spans.setdefault(r["span"], []).append(r)
    total = lambda name: sum(r["s"] for r in spans.get(name, []))  # noqa: E731
    moved = sum(r.get("bytes", 0) for r in spans.get("tensors", [])) / 1e9
    rel = lambda name: events[name] - t0 if name in events else float("nan")  # noqa: E731
    return Run(backend, which, code, rel("start"), events.get("imported", float("nan")) - events.get("start", float("nan")),
               total("tensors"), moved, total("prepare"), rel("loaded"), total("graph_warmup"),
               total("graph_capture"), total("nvrtc"), (t_first - t0) if first else float("nan"), t_done - t0,
               "" if code == 0 else (err.strip().splitlines() or [""])[-1],
               {name: round(total(name), 3) for name in spans},
               max((r["end"] - t0 for r in spans.get("precompile_compile", [])), default=float("nan")))


def _await_helper(log: Path, timeout: float = 300) -> None:
    """A command that succeeds lets its precompile helper finish (backends/kernels/precompile.py):
    wait for its process to end (its marker written), so that the next run neither starts beside it
    nor finds its work half done."""
    if not log.exists():
        return
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    helper = next((r["helper"] for r in records if r.get("event") == "precompile_spawned"), None)
    deadline = time.monotonic() + timeout
    while helper is not None and _alive(helper) and time.monotonic() < deadline:
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited but not reaped, does not; the helper runs only
    on Linux, where /proc tells)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _first_sample(pipe) -> bool:
    """Read a streamed WAV up to its first sample byte (the header is written before any audio)."""
    head = pipe.read(12)
    if len(head) < 12 or head[:4] != b"RIFF":
        return False
    while True:
        chunk = pipe.read(8)
        if len(chunk) < 8:
            return False
        size = int.from_bytes(chunk[4:], "little")
        if chunk[:4] == b"data":
            return len(pipe.read(1)) == 1
        pipe.read(size + (size & 1))


def run(model: str, backends: tuple[str, ...], device: str = "auto") -> list[Run]:
    if not Path(model).is_dir():
        raise UsageError(f"--startup measures a checkpoint directory: {model} is not one")
    runs = []
    for backend in backends:
        with tempfile.TemporaryDirectory(prefix="minicpm-startup-") as tmp:
            for which in ("first", "second"):
                print(f"bench: startup {backend}: {which} process", file=sys.stderr, flush=True)
                runs.append(_measure(backend, which, model, Path(tmp), device))
    return runs


def table(runs: list[Run], model: str) -> str:
    head = ("| backend | run | exec -> imported (s) | tensors read + copied (s) | GB/s | weight prep (s) | "
            "exec -> loaded (s) | JIT in first steps (s) | graph captures (s) | NVRTC (s) | "
            "exec -> first audio byte (s) | exec -> done (s) |")
    lines = [f"`minicpm say \"{TEXT}\" -o -` in fresh processes, checkpoint {model} (page cache not dropped):", "",
             head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in runs:
        if r.exit_code:
            lines.append(f"| {r.backend} | {r.which} | failed (exit {r.exit_code}): {r.error} |")
            continue
        rate = r.gbytes / r.tensors if r.tensors else float("nan")
        lines.append(f"| {r.backend} | {r.which} | {r.exec_to_start + r.imports:.2f} | {r.tensors:.2f} | {rate:.1f} | "
                     f"{r.prepare:.2f} | {r.loaded:.2f} | {r.jit:.2f} | {r.captures:.2f} | {r.nvrtc:.2f} | "
                     f"{r.first_byte:.2f} | {r.done:.2f} |")
    lines += ["", "Loading, phase by phase (s; the model stages include their tensor reads):", ""]
    for r in runs:
        if not r.exit_code:
            parts = ", ".join(f"{k.removeprefix('load_')} {v:.2f}" for k, v in r.spans.items() if k.startswith(("load_", "cuda", "precompile")))
            if r.helper_done == r.helper_done:  # (not nan: a helper compiled this run's kernels)
                parts += f"; the helper's kernels all compiled {r.helper_done:.2f} s after exec"
            lines.append(f"- {r.backend}, {r.which} run: {parts}")
    return "\n".join(lines) + "\n"
