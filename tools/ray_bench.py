"""Bulk throughput and serving latency through Ray, next to the same work without Ray: the figures of
docs/scale-out.md's per-GPU table. One GPU is enough: each configuration runs alone, one after the
other, in its own processes, as users run them.

    python tools/ray_bench.py --model DIR [--items 200] [--requests 8] [--clients 1,16] [--json FILE]

Bulk: `minicpm bulk` over --items sentences (the bench's read texts, cut into sentences and cycled;
`--seed 1`), in this process's way (no --ray) and with `--ray auto --replicas 1 --gpus-per-replica 1`
(a local Ray with one GPU actor). Reported: the wall time from exec to exit (imports, Ray, loading and
compilation included), and the steady state read from the manifest as it grows: the items written after
the first batch over the time from that batch to the last, as items/s and seconds of audio per second;
and whether the two runs wrote the same bytes (they should: the seeds do not depend on placement).

Serve: `minicpm serve` and `minicpm serve --ray auto --replicas 1`, each warmed up with two requests,
then for each --clients count C, C clients each sending --requests streamed reads one after the other
(`stream_format: audio`, `pcm`, seeded): the time to the first audio byte (TTFA) p50/p90 and the time
to the last byte over the audio's length (RTF) p50. With more clients than one replica serves at once,
TTFA includes the wait in the queue, on both sides alike.

Prints two Markdown tables (stdout); --json writes every sample.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minicpm_cli.cli.bench import READ_TEXTS  # noqa: E402  (the texts `minicpm bench` reads)

KEY = "ray-bench"


def sentences() -> list[str]:
    out = []
    for text in READ_TEXTS:
        out += [s.strip() + ("" if s.strip().endswith((".", "?", "!")) else ".") for s in re.split(r"(?<=[.?!])\s+", text)
                if s.strip()]
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("MINICPM_SERVER", "RAY_ADDRESS")}
    path = os.pathsep.join([str(ROOT), *filter(None, [e.get("PYTHONPATH")])])  # (packages put there too)
    return {**e, "MINICPM_SERVER": "", "PYTHONPATH": path}


def minicpm(*args: str) -> list[str]:
    return [sys.executable, "-m", "minicpm_cli", *args]


# -- bulk -----------------------------------------------------------------------------------------


def bulk(label: str, items: Path, out: Path, model_args: list[str], extra: list[str]) -> dict:
    manifest = out / "manifest.jsonl"
    t0 = time.monotonic()
    proc = subprocess.Popen(minicpm("bulk", str(items), "--out", str(out), "--seed", "1", *model_args, *extra),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env(), text=True)
    seen: list[tuple[float, int]] = []  # (time, lines in the manifest)
    while proc.poll() is None:
        n = manifest.read_text().count("\n") if manifest.exists() else 0
        if not seen or n != seen[-1][1]:
            seen.append((time.monotonic() - t0, n))
        time.sleep(0.02)
    wall = time.monotonic() - t0
    err = proc.stderr.read()
    if proc.returncode != 0:
        raise SystemExit(f"{label}: minicpm bulk failed ({proc.returncode}):\n{err[-3000:]}")
    lines = [json.loads(line) for line in manifest.read_text().splitlines()]
    seen.append((wall, len(lines)))
    total = len(lines)
    start = next((t, n) for t, n in seen if n > 0)  # the first batch written: loading and compilation behind
    end = next(t for t, n in seen if n == total)
    steady_items = total - start[1]
    steady_audio = sum(e["seconds"] for e in lines[start[1]:])
    span = end - start[0]
    return {"label": label, "items": total, "wall_s": wall, "audio_s": sum(e["seconds"] for e in lines),
            "steady_items_per_s": steady_items / span if steady_items and span > 0 else None,
            "steady_audio_per_s": steady_audio / span if steady_items and span > 0 else None, "growth": seen,
            "files": {f.name: f.read_bytes() for f in out.iterdir() if f.name != "manifest.jsonl"}}


# -- serve ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str]) -> tuple[subprocess.Popen, int, list[str]]:
    port = free_port()
    proc = subprocess.Popen(minicpm("serve", "--port", str(port), "--api-key", KEY, *args),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env(), text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    while not any(line.startswith("minicpm: serving ") for line in lines):
        if proc.poll() is not None:
            raise SystemExit(f"minicpm serve {' '.join(args)} exited {proc.returncode}:\n{''.join(lines)[-3000:]}")
        time.sleep(0.1)
    return proc, port, lines


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()


def stream(port: int, text: str, seed: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"model": "tts-1", "voice": "default", "input": text, "response_format": "pcm",
                       "stream_format": "audio", "seed": seed})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/audio/speech", body=body,
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"request failed: {resp.status} {resp.read()[:300]!r}")
    first = None
    size = 0
    while chunk := resp.read1(1 << 16):
        if first is None:
            first = time.perf_counter() - t0
        size += len(chunk)
    total = time.perf_counter() - t0
    conn.close()
    audio = size / 2 / 24000
    return {"ttfa_ms": first * 1e3, "total_s": total, "audio_s": audio, "rtf": total / audio if audio else None}


def load(port: int, clients: int, requests: int, texts: list[str]) -> list[dict]:
    samples: list[dict] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(requests):
            s = stream(port, texts[(c * requests + r) % len(texts)], seed=c * 1000 + r)
            with lock:
                samples.append({"client": c, **s})

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return samples


def serving(label: str, args: list[str], clients: list[int], requests: int, texts: list[str]) -> list[dict]:
    proc, port, _ = start_server(args)
    try:
        for i in range(2):  # warm-up (compilation, first use): not measured
            stream(port, texts[i % len(texts)], seed=i)
        out = []
        for c in clients:
            samples = load(port, c, requests, texts)
            ttfa = [s["ttfa_ms"] for s in samples]
            out.append({"label": label, "clients": c, "requests": len(samples), "ttfa_p50_ms": pct(ttfa, 0.5),
                        "ttfa_p90_ms": pct(ttfa, 0.9), "rtf_p50": pct([s["rtf"] for s in samples], 0.5),
                        "samples": samples})
        return out
    finally:
        stop_server(proc)


# -- report ---------------------------------------------------------------------------------------


def describe() -> str:
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        gpu = "no NVIDIA GPU"
    versions = []
    for mod in ("torch", "ray"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            versions.append(f"{mod} missing")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    day = datetime.date.today().isoformat()
    return f"{gpu}, {', '.join(versions)}, Python {platform.python_version()}, commit {commit or '-'}, {day}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory or hub repo id (minicpm's default otherwise)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--items", type=int, default=200, help="bulk items")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--requests", type=int, default=8, help="streamed reads per client")
    ap.add_argument("--clients", default="1,16", help="concurrent clients, comma-separated")
    ap.add_argument("--gpus-per-replica", default=None, help="[default: 1 with a GPU, else 0]")
    ap.add_argument("--skip", choices=("bulk", "serve"), action="append", default=[])
    ap.add_argument("--json", help="write every sample to FILE")
    opts = ap.parse_args()

    model_args = ["--backend", opts.backend, "--device", opts.device] + (["--model", opts.model] if opts.model else [])
    gpus = opts.gpus_per_replica or ("0" if opts.device == "cpu" else "1")
    ray_args = ["--ray", "auto", "--replicas", "1", "--gpus-per-replica", gpus]
    texts = sentences()
    result = {"environment": describe(), "bulk": [], "serve": []}
    with tempfile.TemporaryDirectory(prefix="ray-bench-") as tmp:
        items = Path(tmp) / "items.jsonl"
        items.write_text("".join(json.dumps({"id": f"item-{i:05d}", "text": texts[i % len(texts)]}) + "\n"
                                 for i in range(opts.items)))
        if "bulk" not in opts.skip:
            for name, label, extra in (("local", "in-process", []),
                                       ("ray", f"Ray Data, 1 actor ({gpus} GPU)", ray_args)):
                print(f"ray_bench: bulk, {label}", file=sys.stderr, flush=True)
                result["bulk"].append(bulk(label, items, Path(tmp) / name, model_args,
                                           ["--batch", str(opts.batch), *extra]))
            files = [b.pop("files") for b in result["bulk"]]
            result["bulk_files_identical"] = files[0] == files[1]
        if "serve" not in opts.skip:
            clients = [int(c) for c in opts.clients.split(",")]
            for label, extra in (("minicpm serve", []), (f"Ray Serve, 1 replica ({gpus} GPU)", ray_args)):
                print(f"ray_bench: serve, {label}", file=sys.stderr, flush=True)
                result["serve"] += serving(label, model_args + extra, clients, opts.requests, texts)

    print(f"Ray scale-out on {result['environment']}\n")
    if result["bulk"]:
        same = "the same bytes" if result["bulk_files_identical"] else "DIFFERENT bytes"
        print(f"Bulk, {opts.items} items (batches of {opts.batch}; both runs wrote {same}):\n")
        print("| run | wall, exec to exit (s) | steady items/s | steady audio s/s | audio (s) |")
        print("|---|---|---|---|---|")
        for b in result["bulk"]:
            steady = "-" if b["steady_items_per_s"] is None else \
                f"{b['steady_items_per_s']:.2f} | {b['steady_audio_per_s']:.1f}"
            print(f"| {b['label']} | {b['wall_s']:.1f} | {steady if '|' in steady else '- | -'} | {b['audio_s']:.1f} |")
        print()
    if result["serve"]:
        print(f"Serving, streamed reads (pcm), {opts.requests} per client:\n")
        print("| server | clients | TTFA p50 / p90 (ms) | RTF p50 | requests |")
        print("|---|---|---|---|---|")
        for s in sorted(result["serve"], key=lambda s: (s["clients"], s["label"])):
            print(f"| {s['label']} | {s['clients']} | {s['ttfa_p50_ms']:.1f} / {s['ttfa_p90_ms']:.1f} | "
                  f"{s['rtf_p50']:.3f} | {s['requests']} |")
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
