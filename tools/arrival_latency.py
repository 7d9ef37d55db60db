"""Time to first audio for text that is still arriving (issue 36's figures): how long after a
clause's last character arrives its first audio leaves, next to the time to first audio of the same
text given whole, on the same machine and backend.

    python tools/arrival_latency.py [--backend compile] [--model DIR] [--runs 10] [--json FILE]

Server (`minicpm serve --random-weights`, lengths forced as the bench forces them), each --runs times,
one request at a time, pcm, streamed, seeded:
- http: `POST /v1/audio/speech` of the clause (connection open), request sent -> first body byte;
- socket: `/v1/audio/speech/stream` open and started; the clause sent as one `text` message (its
  sentence end and the space after it: a part is ready) -> first binary message;
- pipe: `minicpm say -o - --raw` through the server (MINICPM_SERVER), the clause written on its stdin
  as a slow writer would (then a 3 s pause, then the rest) -> first byte on its stdout; and whether
  that byte came before the pause ended.
With --model (a checkpoint directory: `say --local` needs one), the same in one process each run:
- local whole: `say --local CLAUSE`, model loaded (MINICPM_STARTUP_LOG's "loaded") -> first byte;
- local pipe: `say --local` reading stdin: the clause written a second after "loaded" -> first byte.
Prints a Markdown table (p50, p90, min over the runs, ms).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLAUSE = "The first sentence arrives alone. "
REST = "Then the rest of it comes, after the writer thought for a while.\n"
KEY = "arrival-latency"
PAUSE = 3.0


def minicpm(*args: str) -> list[str]:
    return [sys.executable, "-m", "minicpm_cli", *args]


def env(**extra: str) -> dict:
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, "MINICPM_SERVER": "", **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


# -- the server's three ways in ---------------------------------------------------------------------


def start_server(backend: str, model_args: list[str]) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(minicpm("serve", *model_args, "--backend", backend, "--port", str(port), "--api-key", KEY), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=env(), text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    while not any(line.startswith("minicpm: serving ") for line in lines):
        if proc.poll() is not None:
            raise SystemExit(f"minicpm serve exited {proc.returncode}:\n{''.join(lines)[-3000:]}")
        time.sleep(0.1)
    return proc, port


def http_ttfa(port: int, seed: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.connect()
    body = json.dumps({"model": "tts-1", "voice": "default", "input": CLAUSE.strip(), "response_format": "pcm",
                       "stream_format": "audio", "seed": seed})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/audio/speech", body=body,
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"http: {resp.status} {resp.read()[:300]!r}")
    resp.read1(1)
    t = time.perf_counter() - t0
    resp.read()
    conn.close()
    return t


def socket_ttfa(port: int, seed: int) -> float:
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream", max_size=None,
                 additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        ws.send(json.dumps({"type": "start", "model": "tts-1", "voice": "default", "response_format": "pcm",
                            "stream_format": "audio", "seed": seed}))
        time.sleep(0.05)
        t0 = time.perf_counter()
        ws.send(json.dumps({"type": "text", "text": CLAUSE}))
        while isinstance(msg := ws.recv(), str):
            if json.loads(msg).get("type") == "error":
                raise SystemExit(f"socket: {msg}")
        t = time.perf_counter() - t0
        ws.send(json.dumps({"type": "end"}))
        for _ in ws:  # (to the server's close)
            pass
    return t


def pipe_ttfa(cmd: list[str], extra_env: dict, ready) -> tuple[float, bool]:
    """A `say` process reading stdin: `ready(proc)` waits until it can take text; the clause is
    written, then after PAUSE the rest; -> (first byte after the clause, s; whether before PAUSE ended)."""
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env(**extra_env))
    first = threading.Event()
    when: list[float] = []

    def read() -> None:
        while proc.stdout.read1(1 << 16):
            if not when:
                when.append(time.perf_counter())
                first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        ready(proc)
        t0 = time.perf_counter()
        proc.stdin.write(CLAUSE.encode())
        proc.stdin.flush()
        came = first.wait(PAUSE)
        proc.stdin.write(REST.encode())
        proc.stdin.close()
        first.wait(60)
        if not when:
            raise SystemExit(f"{' '.join(cmd[2:4])}: no audio:\n{proc.stderr.read().decode()[-2000:]}")
        return when[0] - t0, came
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def whole_ttfa(model: str, backend: str, device: str) -> float:
    """`say --local CLAUSE`: the model's "loaded" mark -> the first byte on stdout."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "startup.jsonl"
        proc = subprocess.Popen(minicpm("say", "--local", "--model", model, "--backend", backend, "--device", device, "--seed", "1",
                                        "--raw", "-o", "-", CLAUSE.strip()),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env(MINICPM_STARTUP_LOG=str(log)))
        try:
            proc.stdout.read1(1)
            t = time.time()
            loaded = next(json.loads(line)["t"] for line in log.read_text().splitlines()
                          if json.loads(line).get("event") == "loaded")
            return t - loaded
        finally:
            proc.kill()
            proc.wait()


def wait_loaded(log: Path):
    def ready(proc: subprocess.Popen) -> None:
        while not (log.exists() and '"loaded"' in log.read_text()):
            if proc.poll() is not None:
                raise SystemExit(f"say exited {proc.returncode}:\n{proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.05)
        time.sleep(1.0)
    return ready


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="compile")
    ap.add_argument("--model", help="a checkpoint directory, for the in-process rows")
    ap.add_argument("--serve-model", help="serve this checkpoint (default: --random-weights, lengths forced)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--local-runs", type=int, default=2, help="in-process runs (each loads the model)")
    ap.add_argument("--json", help="write every sample to FILE")
    args = ap.parse_args()

    rows: dict[str, list[float]] = {}
    before: dict[str, int] = {}
    proc, port = start_server(args.backend, [*(["--model", args.serve_model] if args.serve_model else ["--random-weights"]),
                                             "--device", args.device])
    try:
        for k in range(2):  # warm-up
            http_ttfa(port, 900 + k)
            socket_ttfa(port, 900 + k)
        rows["server: http, whole clause"] = [http_ttfa(port, k) for k in range(args.runs)]
        rows["server: socket, clause as it arrives"] = [socket_ttfa(port, k) for k in range(args.runs)]
        pipe = []
        for _ in range(max(1, args.runs // 3)):
            t, came = pipe_ttfa(minicpm("say", "--seed", "1", "--raw", "-o", "-"),
                                {"MINICPM_SERVER": f"http://127.0.0.1:{port}", "MINICPM_API_KEY": KEY},
                                lambda p: time.sleep(2.0))
            pipe.append(t)
            before["server: say -o - reading a pipe"] = before.get("server: say -o - reading a pipe", 0) + came
        rows["server: say -o - reading a pipe"] = pipe
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    if args.model:
        rows["local: say TEXT (after load)"] = [whole_ttfa(args.model, args.backend, args.device) for _ in range(args.local_runs)]
        local = []
        for _ in range(args.local_runs):
            with tempfile.TemporaryDirectory() as tmp:
                log = Path(tmp) / "startup.jsonl"
                t, came = pipe_ttfa(minicpm("say", "--local", "--model", args.model, "--backend", args.backend, "--device", args.device,
                                            "--seed", "1", "--raw", "-o", "-"),
                                    {"MINICPM_STARTUP_LOG": str(log)}, wait_loaded(log))
            local.append(t)
            before["local: say reading a pipe"] = before.get("local: say reading a pipe", 0) + came
        rows["local: say reading a pipe"] = local

    print(f"| path ({args.backend}) | runs | TTFA p50 (ms) | p90 | min | first audio before the {PAUSE:g} s pause ended |")
    print("|---|---|---|---|---|---|")
    for name, xs in rows.items():
        ok = f"{before[name]}/{len(xs)}" if name in before else "-"
        print(f"| {name} | {len(xs)} | {1000 * pct(xs, 0.5):.1f} | {1000 * pct(xs, 0.9):.1f} | {1000 * min(xs):.1f} | {ok} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"backend": args.backend, "rows": rows, "before_pause": before}, indent=1))


if __name__ == "__main__":
    main()
