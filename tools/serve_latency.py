"""A one-shot `minicpm say` through a warm `minicpm serve`, timed from outside: where its time goes.

Starts `minicpm serve --random-weights --backend compile` on a free port (or `--model DIR`, with
`--backend`, `--device`, `--dtype` passed through; or uses the server at `--url`), waits until
`GET /health` answers 200, then, after one untimed run of each, `--runs` times (default 7):

- `minicpm say TEXT -o FILE`: exec to exit (the wall time a user waits for the file);
- `minicpm say TEXT -o -`: exec to the first byte on stdout (the WAV header) and to the first sample;
- the phases of both, from the moments the client notes in $MINICPM_STARTUP_LOG (`minicpm_cli/trace.py`):
  interpreter start, the CLI imported, options parsed, the server found (`GET /props`), the request
  sent, the response's headers in (the server sends them with its first chunk), the file written,
  exit; and the server's own time from the request to its first chunk (its `Server-Timing` header);
- then `minicpm bench --server URL --workload read`: time to first audio over HTTP for the bench's texts.

Medians with min-max, as Markdown on stdout (progress on stderr); `--json FILE` keeps every sample.

    python tools/serve_latency.py                              # on a GPU: random weights, compile
    python tools/serve_latency.py --model tests/fixtures/tiny-minicpmo --device cpu --backend eager
    python tools/serve_latency.py --url http://127.0.0.1:8910
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = "Hi, how are you?"
# the client's marks (trace.mark), in the order they happen, and what each ends
PHASES = (("start", "interpreter up, our entry point runs"), ("cli", "CLI imported (typer, our modules)"),
          ("parsed", "options parsed"), ("found", "server found (GET /props)"), ("sent", "request sent"),
          ("response", "response headers in (the server's first chunk)"),
          ("written", "written (the file closed; for -o -, the stream's end)"),
          ("exit", "process gone"))


def minicpm_command(exe: str | None) -> list[str]:
    """The `minicpm` users run: the console script next to this Python, else on PATH, else `-m`."""
    if exe:
        return [exe]
    here = Path(sys.executable).with_name("minicpm")
    if here.exists():
        return [str(here)]
    found = shutil.which("minicpm")
    return [found] if found else [sys.executable, "-m", "minicpm_cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def log(message: str) -> None:
    print(f"serve_latency: {message}", file=sys.stderr, flush=True)


class Server:
    """A `minicpm serve` started here (stopped with SIGTERM at the end), its stderr kept for errors."""

    def __init__(self, cmd: list[str], env: dict):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.decode(errors="replace"))

    def wait_ready(self, url: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise SystemExit(f"serve_latency: the server exited with {self.proc.returncode}:\n{''.join(self.lines)}")
            try:
                if get(url + "/health", timeout=2.0)[0] == 200:
                    return
            except OSError:
                pass  # (not listening yet)
            time.sleep(0.2)
        raise SystemExit(f"serve_latency: no 200 from {url}/health after {timeout:.0f} s:\n{''.join(self.lines)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def first_sample(pipe, t0: float) -> tuple[float | None, float | None]:
    """Seconds from t0 to the first byte of a streamed WAV on `pipe`, and to its first sample byte."""
    head = pipe.read(1)
    t_byte = time.time() - t0 if head else None
    head += pipe.read(11)
    if len(head) < 12 or head[:4] != b"RIFF":
        return t_byte, None
    while True:
        chunk = pipe.read(8)
        if len(chunk) < 8:
            return t_byte, None
        size = int.from_bytes(chunk[4:], "little")
        if chunk[:4] == b"data":
            return t_byte, (time.time() - t0) if pipe.read(1) else None
        pipe.read(size + (size & 1))


def run_say(cmd: list[str], out: str, env: dict) -> dict:
    """One `minicpm say TEXT -o out` in a fresh process: its moments relative to exec, in seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        target = out if out == "-" else str(Path(tmp) / out)
        t0 = time.time()
        proc = subprocess.Popen([*cmd, "say", TEXT, "-o", target], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**env, "MINICPM_STARTUP_LOG": str(trace)})
        byte = sample = None
        if out == "-":
            byte, sample = first_sample(proc.stdout, t0)
        proc.stdout.read()
        err = proc.stderr.read().decode(errors="replace")
        code = proc.wait()
        t_exit = time.time() - t0
        if code != 0:
            raise SystemExit(f"serve_latency: `minicpm say -o {out}` exited with {code}: {err.strip()}")
        marks, server_ms = {}, None
        if trace.exists():
            for line in trace.read_text().splitlines():
                r = json.loads(line)
                if "event" in r:
                    marks.setdefault(r["event"], r["t"] - t0)
                    server_ms = _first_chunk_ms(r.get("server_timing")) or server_ms
    return {**marks, "exit": t_exit, "first_byte": byte, "first_sample": sample, "server_first_chunk_ms": server_ms}


def _first_chunk_ms(header: str | None) -> float | None:
    """`first-chunk;dur=12.3` (Server-Timing) -> 12.3"""
    for metric in (header or "").split(","):
        name, *params = [p.strip() for p in metric.split(";")]
        if name == "first-chunk":
            for p in params:
                if p.startswith("dur="):
                    return float(p[4:])
    return None


def _transport_ms(r: dict) -> float | None:
    if "sent" not in r or "response" not in r or r["server_first_chunk_ms"] is None:
        return None
    return (r["response"] - r["sent"]) * 1e3 - r["server_first_chunk_ms"]


def stat(xs: list[float | None], scale: float = 1e3) -> str:
    xs = [x * scale for x in xs if x is not None]
    if not xs:
        return "-"
    digits = 1 if max(abs(x) for x in xs) < 10 else 0
    return (f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})" if len(xs) > 1
            else f"{xs[0]:.{digits}f}")


def phase_rows(samples: dict[str, list[dict]]) -> list[str]:
    """A row per mark: the time since the mark before it in that run (exec for the first)."""
    rows = []
    names = [name for name, _ in PHASES]
    for name, what in PHASES:
        cells = []
        for runs in samples.values():
            deltas = []
            for r in runs:
                if name in r:
                    before = [r[n] for n in names[: names.index(name)] if n in r]
                    deltas.append(r[name] - (before[-1] if before else 0.0))
            cells.append(stat(deltas))
        if any(c != "-" for c in cells):
            rows.append(f"| {what} | " + " | ".join(cells) + " |")
    return rows


def bench_server(cmd: list[str], url: str, runs: int, env: dict) -> dict | None:
    """`minicpm bench --server URL --workload read`: its read row (TTFA over HTTP), or None if it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        p = subprocess.run([*cmd, "bench", "--server", url, "--workload", "read", "--runs", str(runs),
                            "--warmup", "1", "--json", str(out)], capture_output=True, env=env)
        if p.returncode != 0:
            log(f"bench --server failed ({p.returncode}): {p.stderr.decode(errors='replace').strip()[-500:]}")
            return None
        return json.loads(out.read_text())["results"][0]


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def versions() -> str:
    def v(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "-"

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return (f"Python {platform.python_version()}, typer {v('typer')}, numpy {v('numpy')}, soundfile {v('soundfile')}, "
            f"commit {commit.stdout.strip() or '-'}"
            + (", PYTHONDONTWRITEBYTECODE set (our modules compiled at every start)"
               if os.environ.get("PYTHONDONTWRITEBYTECODE") else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="measure the server at URL instead of starting one")
    ap.add_argument("--model", help="serve this checkpoint (default: --random-weights)")
    ap.add_argument("--backend", default="compile", help="serve's --backend (default compile)")
    ap.add_argument("--device", default="auto", help="serve's --device")
    ap.add_argument("--dtype", default="auto", help="serve's --dtype")
    ap.add_argument("--runs", type=int, default=7, help="timed runs of each command (default 7)")
    ap.add_argument("--bench-runs", type=int, default=3, help="bench --server --runs (0: skip it)")
    ap.add_argument("--exe", help="the minicpm executable to time [default: the one next to this Python]")
    ap.add_argument("--ready-timeout", type=float, default=1800, help="seconds to wait for /health (load, warm-up)")
    ap.add_argument("--json", help="write every sample to FILE")
    args = ap.parse_args()
    if args.url and args.model:
        ap.error("--url measures a running server: --model is for the server started here")
    if args.runs < 1:
        ap.error("--runs must be at least 1")

    cmd = minicpm_command(args.exe)
    env = {k: v for k, v in os.environ.items() if k not in ("MINICPM_STARTUP_LOG", "MINICPM_DEBUG")}
    server = None
    url = args.url.rstrip("/") if args.url else None
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve = [*cmd, "serve", "--port", str(port), "--backend", args.backend, "--device", args.device,
                 "--dtype", args.dtype, *(["--model", args.model] if args.model else ["--random-weights"])]
        log(" ".join(serve))
        server = Server(serve, env)
    try:
        if server:
            server.wait_ready(url, args.ready_timeout)
        props = json.loads(get(url + "/props")[1])
        env["MINICPM_SERVER"] = url
        log(f"server ready: {props.get('backend')}, {props.get('device')}, {props.get('model')}; "
            f"{args.runs} runs of each command")
        for out in ("hi.wav", "-"):  # untimed: bytecode caches, page cache, the server's first request
            run_say(cmd, out, env)
        samples: dict[str, list[dict]] = {"-o FILE": [], "-o -": []}
        for i in range(args.runs):
            samples["-o FILE"].append(run_say(cmd, "hi.wav", env))
            samples["-o -"].append(run_say(cmd, "-", env))
            log(f"run {i + 1}/{args.runs}")
        bench = bench_server(cmd, url, args.bench_runs, env) if args.bench_runs > 0 else None
    finally:
        if server:
            server.stop()

    environment = props.get("environment", {})
    lines = [
        f"`minicpm say \"{TEXT}\"` through `minicpm serve` ({props.get('backend')}, {props.get('device')}, "
        f"{environment.get('device', '-')}, model {props.get('model')}) at {url}, "
        f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; {versions()}.",
        f"Median (min-max) of {args.runs} runs each, ms from exec.",
        "",
        "| measure | -o FILE | -o - |",
        "|---|---|---|",
        "| wall: exec -> exit | " + " | ".join(stat([r["exit"] for r in runs]) for runs in samples.values()) + " |",
        "| exec -> first byte on stdout (WAV header) | - | " + stat([r["first_byte"] for r in samples["-o -"]]) + " |",
        "| exec -> first sample on stdout | - | " + stat([r["first_sample"] for r in samples["-o -"]]) + " |",
        "| server: request -> first chunk (Server-Timing) | "
        + " | ".join(stat([r["server_first_chunk_ms"] for r in runs], scale=1) for runs in samples.values()) + " |",
        "| HTTP: request sent -> response in, less the server's time | "
        + " | ".join(stat([_transport_ms(r) for r in runs], scale=1) for runs in samples.values()) + " |",
        "",
        "Phases: ms from the moment before (exec for the first), from the client's $MINICPM_STARTUP_LOG marks.",
        "",
        "| until | -o FILE | -o - |",
        "|---|---|---|",
        *phase_rows(samples),
    ]
    if bench is not None:
        lines += ["", f"`minicpm bench --server {url} --workload read --runs {args.bench_runs}` (its three texts):",
                  "", "| TTFA over HTTP p50 / p90 (ms) | RTF p50 / p90 |", "|---|---|",
                  f"| {_f(bench['ttfa_ms']['p50'], '.1f')} / {_f(bench['ttfa_ms']['p90'], '.1f')} "
                  f"| {_f(bench['rtf']['p50'], '.3f')} / {_f(bench['rtf']['p90'], '.3f')} |"]
    sys.stdout.write("\n".join(lines) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"url": url, "props": props, "samples": samples, "bench": bench},
                                              indent=1) + "\n")


if __name__ == "__main__":
    main()
