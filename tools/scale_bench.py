"""Scale-out measured on GPUs: bulk and serving on 1, 2 and 4 GPUs, a two-node cluster, replicas killed
mid-job; every table of docs/scale-out.md from one invocation on a 4-GPU machine.

    python tools/scale_bench.py (--random-weights | --model DIR) [--backend compile]
        [--parts bulk,serve,cluster,kill] [--items 2400] [--sentences 1-3] [--batch 64] [--replicas 1,2,4]
        [--clients 1,16,64] [--requests 2] [--serve-batch 16] [--subset 256] [--parallel]
        [--timeout 480] [--deadline 540] [--json FILE] [--work DIR]
    python tools/scale_bench.py --report FILE      # the tables again, from a --json file

Each run is its own processes, as users run them (`minicpm bulk`, `minicpm serve`, with and without
`--ray auto`), on the GPUs CUDA_VISIBLE_DEVICES gives it; with --parallel, runs that fit on disjoint
GPUs at once run at the same time (in-process on GPU 0, Ray with 1 replica on GPU 1, 2 replicas on
GPUs 2-3; the tables say which ran together). Each run has a time limit (--timeout, and none past
--deadline seconds from the start); a run that fails or times out is recorded and the rest go on;
--json is rewritten after every run, so a command killed at its limit leaves what it measured.

bulk: `minicpm bulk` over --items items (--sentences of the bench's read sentences each, drawn with
a fixed seed; `--seed 7`), in this process (1 GPU) and with `--ray auto --replicas N` for each N of
--replicas (with --on-cluster, `--ray ADDRESS` of a one-node cluster started on the run's GPUs before
it: a job on a running cluster, Ray's own start left out of its wall time). Per run: the wall time
from exec to exit; start-up, to the last replica loaded; the first file; the steady throughput
(audio seconds per second while every replica generates: from the marks each batch leaves in
$MINICPM_STARTUP_LOG); the tail (the last replica's work after the first ran out); the driver's
time writing files; and every file's SHA-256 against the in-process run's.
serve: `minicpm serve` (1 GPU) and `serve --ray auto --replicas N`, --serve-batch rows each; for each
--clients count C, C clients each sending --requests streamed reads (pcm, seeded) one after another:
TTFA p50/p90 and the aggregate audio seconds per second. cluster: a head and a worker node
(tools/ray_cluster.py, the GPUs split between them) and `bulk --ray ADDRESS` over both, on the job's
last --subset items (its shortest batches, the same batches as the one-node runs): same bytes? kill:
one bulk replica SIGKILLed mid-job (every item exactly once, same bytes), one Serve replica SIGKILLed
under 2 x --serve-batch long streams (each stream whole with its bytes, or an error; none cut short
and ended as if whole; new requests then succeed).

Without GPUs (--device cpu, a tiny --model, --greedy, short --texts) every part runs on the CPU: a
dry run of the tool (docs/scale-out.md has the command). A run's files (its spec, stderr, trace and
result) stay in --work DIR when one is given.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import http.client
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from minicpm_cli.cli.bench import READ_TEXTS, percentile  # noqa: E402  (the texts `minicpm bench` reads)

KEY = "scale-bench"
SEED = 7
LONG_TEXT = " ".join(READ_TEXTS)  # a stream in flight when a replica dies


def sentences() -> list[str]:
    out = []
    for text in READ_TEXTS:
        parts = [s.strip() for s in re.split(r"(?<=[.?!])\s+", text) if s.strip()]
        out += [s + ("" if s.endswith((".", "?", "!")) else ".") for s in parts]
    return out


def job_rows(n: int, counts: tuple[int, int], pool: list[str]) -> list[dict]:
    """n items, each `counts[0]..counts[1]` texts of `pool` (a fixed draw): texts of many lengths."""
    rng = random.Random(SEED)
    return [{"id": f"item-{i:05d}", "text": " ".join(rng.choice(pool) for _ in range(rng.randint(*counts)))}
            for i in range(1, n + 1)]


def subset_ids(rows: list[dict], batch: int, count: int) -> list[str]:
    """The ids of the job's last whole batches covering about `count` items (its shortest): spoken on
    their own, they make the same batches as in the whole job (bulk.batches)."""
    from minicpm_cli.scale import bulk

    plan = bulk.batches(bulk.plan(rows, fmt="wav", greedy=False, seed=SEED, base=ROOT), batch)
    keep = plan[-max(1, -(-count // batch)):]
    return [i.id for group in keep for i in group]


def env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("MINICPM_SERVER", "RAY_ADDRESS", "MINICPM_STARTUP_LOG")}
    path = os.pathsep.join([str(ROOT), *filter(None, [e.get("PYTHONPATH")])])  # (packages put there too)
    return {**e, "MINICPM_SERVER": "", "PYTHONPATH": path, **extra}


def minicpm(*args: str) -> list[str]:
    return [sys.executable, "-m", "minicpm_cli", *args]


def read_trace(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def hashes(directory: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir())
            if f.suffix == ".wav"}


# -- bulk -----------------------------------------------------------------------------------------


def bulk(label: str, items: Path, out: Path, model_args: list[str], extra: list[str]) -> dict:
    """`minicpm bulk` run once, its files kept in memory (tools/load_parity.py's comparisons)."""
    r = bulk_run({"label": label, "items": str(items), "out": str(out), "args": [*model_args, *extra],
                  "timeout": 3600, "keep": True}, Path(tempfile.mkdtemp(prefix="bulk-")))
    if r.get("error"):
        raise SystemExit(f"{label}: {r['error']}")
    r["files"] = {f.name: f.read_bytes() for f in out.iterdir() if f.name != "manifest.jsonl"}
    return r


def bulk_run(spec: dict, work: Path, extra_env: dict | None = None) -> dict:
    """One `minicpm bulk` job timed from exec to exit, its manifest watched, its trace read; with
    spec["kill"], one replica SIGKILLed once a tenth of the items are written."""
    out, trace_path = Path(spec["out"]), work / "trace.jsonl"
    manifest = out / "manifest.jsonl"
    total = sum(1 for line in Path(spec["items"]).read_text().splitlines() if line.strip())
    draw = ["--greedy"] if spec.get("greedy") else ["--seed", str(SEED)]
    args = ["bulk", spec["items"], "--out", str(out), *draw, "-v", *spec["args"]]
    e = env(MINICPM_STARTUP_LOG=str(trace_path), **(extra_env or {}))
    if spec.get("gpus") is not None:
        e["CUDA_VISIBLE_DEVICES"] = spec["gpus"]
    t0 = time.time()
    proc = subprocess.Popen(minicpm(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=e, text=True)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    seen: list[tuple[float, int]] = []  # (seconds since exec, lines in the manifest)
    killed = None
    deadline = time.monotonic() + spec["timeout"]
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            return {"label": spec["label"], "error": f"timed out after {spec['timeout']:.0f} s",
                    "stderr": "".join(err)[-3000:]}
        n = manifest.read_text().count("\n") if manifest.exists() else 0
        if not seen or n != seen[-1][1]:
            seen.append((time.time() - t0, n))
        if spec.get("kill") and killed is None and max(1, total // 10) <= n < total:
            pids = [r["pid"] for r in read_trace(trace_path) if r.get("event") == "speaker_ready"]
            if pids:
                killed = pids[0]
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    wall = time.time() - t0
    if proc.returncode != 0:
        return {"label": spec["label"], "error": f"exit {proc.returncode}", "stderr": "".join(err)[-3000:]}
    lines = [json.loads(line) for line in manifest.read_text().splitlines()]
    seen.append((wall, len(lines)))
    result = {"label": spec["label"], "items": len(lines), "wall_s": wall, "audio_s": sum(e["seconds"] for e in lines),
              "growth": seen, **bulk_marks(read_trace(trace_path), t0), **legacy_steady(seen, lines)}
    result["hashes"] = hashes(out)
    result["exactly_once"] = (len(lines) == len({e["id"] for e in lines}) == len(result["hashes"]) == total)
    if spec.get("kill"):
        result["killed_pid"] = killed
    if not spec.get("keep"):
        shutil.rmtree(out, ignore_errors=True)
    return result


def legacy_steady(seen: list[tuple[float, int]], lines: list[dict]) -> dict:
    """The first file, and the throughput from it to the last file (the manifest's growth: counts the
    other replicas' first batches as steady work, so it overstates several replicas)."""
    total = len(lines)
    start = next(((t, n) for t, n in seen if n > 0), None)
    if start is None:
        return {"first_file_s": None}
    end = next(t for t, n in seen if n == total)
    span = end - start[0]
    audio = sum(e["seconds"] for e in lines[start[1]:])
    return {"first_file_s": start[0], "manifest_audio_per_s": audio / span if span > 0 and total > start[1] else None}


def bulk_marks(marks: list[dict], t0: float) -> dict:
    """From the run's trace: replicas ready, the steady window (every replica generating: from the
    last replica's first batch to the first replica's last), its throughput, the tail after it, and
    the driver's writing."""
    ready = {}
    for m in marks:
        if m.get("event") == "speaker_ready" and m["pid"] not in ready:
            ready[m["pid"]] = m
    runs: dict[int, list[tuple[float, float, float]]] = {}
    for m in marks:
        if m.get("event") == "bulk_batch":
            runs.setdefault(m["pid"], []).append((m["began"], m["t"], m["audio_s"]))
    writes = [(m["began"], m["t"]) for m in marks if m.get("event") == "bulk_written"]
    out = {"replicas_seen": len(ready), "gpus_seen": sorted({str(m.get("gpus")) for m in ready.values()}),
           "ready_first_s": min((m["t"] for m in ready.values()), default=t0) - t0 if ready else None,
           "ready_all_s": max(m["t"] for m in ready.values()) - t0 if ready else None,
           "writing_s": sum(b - a for a, b in writes),
           "ray_connected_s": next((m["t"] - t0 for m in marks if m.get("event") == "ray_connected"), None),
           "ray_dataset_s": next((m["t"] - t0 for m in marks if m.get("event") == "ray_dataset"), None)}
    if not runs:
        return out
    begin = max(min(b for b, _, _ in r) for r in runs.values())
    end = min(max(e for _, e, _ in r) for r in runs.values())
    last = max(e for r in runs.values() for _, e, _ in r)
    out["batches"] = sum(len(r) for r in runs.values())
    out["busy_audio_per_s"] = {str(pid): sum(a for _, _, a in r) / sum(e - b for b, e, _ in r)
                               for pid, r in runs.items()}
    out["tail_s"] = last - end
    out["last_write_after_last_batch_s"] = max((b for _, b in writes), default=last) - last
    if end > begin:
        audio = sum(a * max(0.0, min(e, end) - max(b, begin)) / (e - b)
                    for r in runs.values() for b, e, a in r if e > b)
        out["steady_audio_per_s"] = audio / (end - begin)
        out["steady_window_s"] = end - begin
    return out


def bulk_job(spec: dict, work: Path) -> dict:
    """A bulk run; with spec["on_cluster"], a Ray run joins a one-node cluster (`ray start`, on the
    run's GPUs) started first and not timed, as a job on a running cluster does, instead of the local
    Ray that `--ray auto` starts (whose start counts in the wall time)."""
    if spec.get("on_cluster") and spec.get("replicas"):
        return bulk_on_nodes(spec, work, [spec.get("gpus")])
    return bulk_run(spec, work)


def cluster_run(spec: dict, work: Path) -> dict:
    """`bulk --ray ADDRESS` over a head and a worker node started here."""
    return bulk_on_nodes(spec, work, [spec["head_gpus"], spec["worker_gpus"]], spec.get("num_cpus"))


def bulk_on_nodes(spec: dict, work: Path, gpus: list, num_cpus: int | None = None) -> dict:
    """`bulk --ray ADDRESS` (in place of the spec's own --ray) over nodes started here for the run
    (tools/ray_cluster.py, a node for each entry of `gpus`), their start not timed (cluster_start_s)."""
    from ray_cluster import nodes

    args = list(spec["args"])
    if "--ray" in args:
        del args[args.index("--ray") : args.index("--ray") + 2]
    t0 = time.time()
    # (the nodes' actors write their marks to the run's trace, as a one-node run's do)
    with nodes(gpus, num_cpus, env={"MINICPM_STARTUP_LOG": str(work / "trace.jsonl")}) as cluster:
        up = time.time() - t0
        result = bulk_run({**spec, "args": [*args, "--ray", cluster.address]}, work, cluster.env)
    result["cluster_start_s"] = up
    return result


# -- serve ----------------------------------------------------------------------------------------


def start_server(args: list[str], extra_env: dict | None = None,
                 timeout: float = 600) -> tuple[subprocess.Popen, int, list[str]]:
    from ray_cluster import free_port

    port = free_port()
    proc = subprocess.Popen(minicpm("serve", "--port", str(port), "--api-key", KEY, *args),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env(**(extra_env or {})), text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    end = time.monotonic() + timeout
    while not any(line.startswith("minicpm: serving ") for line in lines):
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            raise RuntimeError(f"minicpm serve {' '.join(args)} did not start ({proc.returncode}):\n"
                               f"{''.join(lines)[-3000:]}")
        time.sleep(0.1)
    return proc, port, lines


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()


def stream(port: int, text: str, seed: int | None, keep: bool = False, first_audio=None) -> dict:
    """One streamed read (pcm): TTFA, total, audio seconds; its bytes with `keep`; "error" when the
    request failed or its body broke off. `first_audio()` is called when its first audio arrives."""
    t0 = time.perf_counter()
    first, size, parts = None, 0, []
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
        body = json.dumps({"model": "tts-1", "voice": "default", "input": text, "response_format": "pcm",
                           "stream_format": "audio", **({"greedy": True} if seed is None else {"seed": seed})})
        conn.request("POST", "/v1/audio/speech", body=body,
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {resp.read()[:200]!r}", "t0": t0}
        while chunk := resp.read1(1 << 16):
            if first is None:
                first = time.perf_counter() - t0
                if first_audio is not None:
                    first_audio()
            size += len(chunk)
            if keep:
                parts.append(chunk)
        conn.close()
    except (OSError, http.client.HTTPException) as e:
        return {"error": f"{type(e).__name__}: {e}"[:300], "t0": t0, "bytes": size}
    end = time.perf_counter()
    out = {"ttfa_ms": None if first is None else first * 1e3, "total_s": end - t0, "audio_s": size / 2 / 24000,
           "t0": t0, "t1": end}
    if keep:
        out["data"] = b"".join(parts)
    return out


def load(port: int, clients: int, requests: int, texts: list[str], greedy: bool) -> dict:
    """`clients` clients, each sending `requests` reads one after another: TTFA p50/p90 over them all,
    the aggregate audio seconds per second from the first request sent to the last byte received."""
    samples: list[dict] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(requests):
            s = stream(port, texts[(c * requests + r) % len(texts)], seed=None if greedy else c * 1000 + r)
            with lock:
                samples.append({"client": c, **s})

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    good = [s for s in samples if "error" not in s]
    ttfa = [s["ttfa_ms"] for s in good if s["ttfa_ms"] is not None]
    span = max((s["t1"] for s in good), default=0) - min((s["t0"] for s in samples), default=0)
    return {"clients": clients, "requests": len(samples), "errors": len(samples) - len(good),
            "ttfa_p50_ms": percentile(ttfa, 0.5), "ttfa_p90_ms": percentile(ttfa, 0.9),
            "audio_per_s": sum(s["audio_s"] for s in good) / span if good and span > 0 else None,
            "samples": [{k: v for k, v in s.items() if k not in ("t0", "t1")} for s in samples]}


def serve_run(spec: dict, work: Path) -> dict:
    """A server started, warmed up (two requests a replica at once), then loaded at each client count."""
    trace_path = work / "trace.jsonl"
    extra = {"MINICPM_STARTUP_LOG": str(trace_path)}
    if spec.get("gpus") is not None:
        extra["CUDA_VISIBLE_DEVICES"] = spec["gpus"]
    t0 = time.time()
    proc, port, _ = start_server(spec["args"], extra, timeout=spec["timeout"])
    result = {"label": spec["label"], "ready_s": time.time() - t0, "loads": []}
    try:
        texts = spec["texts"]
        warm = [threading.Thread(target=stream, args=(port, texts[i % len(texts)], 10**6 + i))
                for i in range(2 * max(1, spec["replicas"]))]
        for t in warm:
            t.start()
        for t in warm:
            t.join()
        for clients in spec["clients"]:
            result["loads"].append(load(port, clients, spec["requests"], texts, spec.get("greedy", False)))
            Path(spec["partial"]).write_text(json.dumps(result))  # (a run cut off at its limit keeps these)
        replicas = {m["pid"]: m.get("gpus") for m in read_trace(trace_path) if m.get("event") == "replica_ready"}
        result["replica_gpus"] = sorted(str(g) for g in replicas.values())
        if spec.get("kill"):
            result["kill"] = kill_replica(port, list(replicas), spec["streams"], spec["long_text"],
                                          spec.get("greedy", False))
    finally:
        stop_server(proc)
    return result


def kill_replica(port: int, pids: list[int], count: int, text: str, greedy: bool) -> dict:
    """`count` long streams; once two stream audio, one replica SIGKILLed. Each stream that ended
    whole is compared with the same request sent again (a seeded read gives the same bytes): equal,
    or it was cut short and ended as if whole; the failed ones are errors. Then new requests."""
    results: dict[int, dict] = {}
    flowing = threading.Semaphore(0)

    def ask(i: int) -> None:
        results[i] = stream(port, text, None if greedy else 500 + i, keep=True, first_audio=flowing.release)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    victim = None
    if pids and all(flowing.acquire(timeout=300) for _ in range(2)):
        victim = pids[0]
        os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join()
    whole = {i: r for i, r in results.items() if "error" not in r}
    failed = {i: r["error"] for i, r in results.items() if "error" in r}
    again = {i: stream(port, text, None if greedy else 500 + i, keep=True) for i in list(whole)[:4] + list(failed)[:2]}
    cut = [i for i in whole if i in again and "data" in again[i] and whole[i]["data"] != again[i]["data"]]
    return {"streams": count, "killed_pid": victim, "whole": len(whole), "failed": len(failed),
            "errors": sorted(set(failed.values()))[:5], "whole_checked": len([i for i in whole if i in again]),
            "whole_but_different": cut, "later_requests_ok": all("error" not in again[i] for i in again)}


# -- one run, in a process of its own ----------------------------------------------------------------


RUNNERS = {"bulk": bulk_job, "cluster": cluster_run, "serve": serve_run}


def child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    work = Path(spec_path).parent
    try:
        result = RUNNERS[spec["kind"]](spec, work)
    except Exception as e:  # (recorded: the other runs go on)
        result = {"label": spec["label"], "error": f"{type(e).__name__}: {e}"[-3000:]}
    Path(spec["result"]).write_text(json.dumps(result))


RUNNING: set[int] = set()  # process groups of the runs in flight


def kill_running() -> None:
    for pgid in list(RUNNING):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stop_all(signum, frame) -> None:
    """SIGTERM: stop every run (its servers, Rays, nodes), then end as Ctrl-C would."""
    kill_running()
    raise KeyboardInterrupt


def launch(spec: dict, work: Path) -> dict:
    """Run `spec` in a child process (its own process group, so that a timeout stops everything it
    started: servers, local Rays, the nodes of a cluster); its result or what went wrong."""
    work.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "result": str(work / "result.json"), "partial": str(work / "partial.json")}
    (work / "spec.json").write_text(json.dumps(spec))
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, __file__, "--run", str(work / "spec.json")], env=env(),
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=open(work / "stderr.txt", "w"))
    RUNNING.add(proc.pid)
    try:
        proc.wait(timeout=spec["timeout"] + 60)
    except subprocess.TimeoutExpired:
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):  # (whatever it left running)
        try:
            os.killpg(proc.pid, sig)
            time.sleep(3 if sig == signal.SIGTERM else 0)
        except ProcessLookupError:
            break
    proc.wait()
    RUNNING.discard(proc.pid)
    try:
        result = json.loads((work / "result.json").read_text())
    except (OSError, ValueError):
        partial = (work / "partial.json")
        result = {"label": spec["label"],
                  "error": f"no result (exit {proc.returncode}, timeout {spec['timeout']:.0f} s)",
                  **(json.loads(partial.read_text()) if partial.exists() else {}),
                  "stderr": (work / "stderr.txt").read_text()[-3000:]}
    gpus = spec.get("gpus") if spec["kind"] != "cluster" else \
        (f"{spec['head_gpus']} + {spec['worker_gpus']}" if spec["head_gpus"] else None)
    return {**result, "part": spec["part"], "replicas": spec.get("replicas"), "reference": spec.get("reference", False),
            "gpus": gpus, "started_s": t0, "run_s": time.time() - t0}


# -- the plan ---------------------------------------------------------------------------------------


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len([line for line in out.splitlines() if line.startswith("GPU ")])


def plan_runs(opts, slots: int, on_gpu: bool) -> list[dict]:
    """The runs of the parts asked for, each with how many GPUs ("slots") it takes."""
    model = [*(["--random-weights"] if opts.random_weights else []), *(["--model", opts.model] if opts.model else []),
             "--backend", opts.backend, "--device", opts.device, "--dtype", opts.dtype]
    per = "1" if on_gpu else "0"

    def on_ray(n: int) -> list[str]:
        return ["--ray", "auto", "--replicas", str(n), "--gpus-per-replica", per]
    replicas = [n for n in opts.replicas if n <= slots or not on_gpu]
    runs = []
    parts = opts.parts
    if "bulk" in parts:
        base = [*model, "--batch", str(opts.batch)]
        runs.append({"part": "bulk", "kind": "bulk", "label": "in-process (1 GPU)", "slots": 1, "args": base,
                     "replicas": 0, "reference": True})
        for n in replicas:
            runs.append({"part": "bulk", "kind": "bulk", "label": f"Ray Data, {n} replica{'s' * (n > 1)}", "slots": n,
                         "replicas": n, "args": [*base, *on_ray(n)], "on_cluster": opts.on_cluster})
    if "serve" in parts:
        base = [*model, "--batch", str(opts.serve_batch)]
        runs.append({"part": "serve", "kind": "serve", "label": "minicpm serve (1 GPU)", "slots": 1, "args": base,
                     "replicas": 0})
        for n in replicas:
            runs.append({"part": "serve", "kind": "serve", "label": f"Ray Serve, {n} replica{'s' * (n > 1)}",
                         "slots": n, "replicas": n, "args": [*base, *on_ray(n)]})
    n = max(2, slots)
    if "cluster" in parts:
        runs.append({"part": "cluster", "kind": "cluster", "label": f"two nodes ({n // 2} + {n - n // 2} GPUs), "
                     f"{n} replicas" if on_gpu else "two nodes (CPU), 2 replicas", "slots": n, "subset": True,
                     "args": [*model, "--batch", str(opts.batch), "--replicas", str(n), "--gpus-per-replica", per]})
    if "kill" in parts:
        runs.append({"part": "kill", "kind": "bulk", "label": "bulk, 2 replicas, one SIGKILLed", "slots": 2,
                     "subset": True, "kill": True, "args": [*model, "--batch", str(opts.batch), *on_ray(2)]})
        runs.append({"part": "kill", "kind": "serve", "label": "Ray Serve, 2 replicas, one SIGKILLed", "slots": 2,
                     "replicas": 2, "kill": True, "clients": [], "streams": 2 * opts.serve_batch,
                     "args": [*model, "--batch", str(opts.serve_batch), *on_ray(2)]})
    return runs


def groups(runs: list[dict], slots: int, parallel: bool) -> list[list[dict]]:
    """Runs in order, several at once (with `parallel`) while their slots fit on the machine's."""
    if not parallel:
        return [[r] for r in runs]
    out: list[list[dict]] = []
    for r in runs:
        if out and sum(x["slots"] for x in out[-1]) + r["slots"] <= slots and r["kind"] != "cluster" \
                and all(x["kind"] != "cluster" for x in out[-1]):
            out[-1].append(r)
        else:
            out.append([r])
    return out


def assign(group: list[dict], slots: int, on_gpu: bool) -> None:
    """CUDA_VISIBLE_DEVICES for each run of a group: consecutive GPUs (none on a CPU)."""
    at = 0
    for r in group:
        ids = [str(i) for i in range(at, at + r["slots"])] if on_gpu else []
        at += r["slots"]
        if r["kind"] == "cluster":
            half = len(ids) // 2
            r["head_gpus"], r["worker_gpus"] = (",".join(ids[:half]), ",".join(ids[half:])) if on_gpu else ("", "")
            r["num_cpus"] = None if on_gpu else 1
        else:
            r["gpus"] = ",".join(ids) if on_gpu else None


# -- report -----------------------------------------------------------------------------------------


def f(x, fmt=".1f", none="-") -> str:
    return none if x is None else format(x, fmt)


def tables(result: dict) -> str:
    out = [f"Scale-out on {result['environment']}\n"]
    runs = result["runs"]
    together = [g for g in result.get("groups", []) if len(g) > 1]
    if together:
        out.append("Ran at the same time, on disjoint GPUs: " + "; ".join(" + ".join(g) for g in together) + ".\n")
    ref = next((r for r in runs if r.get("reference") and "hashes" in r), None)
    bulk_runs = [r for r in runs if r["part"] == "bulk"]
    if bulk_runs:
        o = result["options"]
        draw = "--greedy" if o.get("greedy") else f"--seed {SEED}"
        ray = ("Ray runs join a running one-node cluster on their GPUs (`ray start`, before the run, not in its "
               "wall time)" if o.get("on_cluster") else "Ray runs start their own local Ray (in their wall time)")
        out.append(f"Bulk, {o['items']} items ({o['sentences']} texts each), --batch {o['batch']}, {draw}; {ray}; "
                   f"steady = audio s/s while every replica generates; start-up's share of the wall time in "
                   f"brackets; speed-ups against Ray with 1 replica (in-process in brackets):\n")
        out.append("| run | GPUs | wall (s) | start-up (s): Ray joined / dataset / all replicas loaded "
                   "| first file (s) | steady audio s/s | steady speed-up | wall speed-up | tail (s) "
                   "| driver writing (s) | files equal to in-process |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|")
        one = next((r for r in bulk_runs if r.get("replicas") == 1 and "error" not in r), None)
        local = next((r for r in bulk_runs if r.get("reference") and "error" not in r), None)
        for r in bulk_runs:
            if "error" in r:
                out.append(f"| {r['label']} | {r.get('gpus') or '-'} | failed: {r['error'][:80]} |||||||||")
                continue
            sp = []
            for key in ("steady_audio_per_s", "wall_s"):
                inv = key == "wall_s"
                cells = []
                for base in (one, local):
                    if base is None or r.get(key) is None or base.get(key) is None:
                        cells.append("-")
                    else:
                        cells.append(f"{(base[key] / r[key]) if inv else (r[key] / base[key]):.2f}x")
                sp.append(f"{cells[0]} ({cells[1]})")
            same = "-" if ref is None else \
                f"{sum(ref['hashes'].get(k) == v for k, v in r['hashes'].items())}/{len(r['hashes'])}"
            start = f"{f(r.get('ray_connected_s'))} / {f(r.get('ray_dataset_s'))} / {f(r.get('ready_all_s'))}"
            if r.get("ready_all_s") is not None and r.get("wall_s"):
                start += f" ({100 * r['ready_all_s'] / r['wall_s']:.0f}%)"
            out.append(f"| {r['label']} | {r.get('gpus') or '-'} | {f(r['wall_s'])} | {start} | "
                       f"{f(r.get('first_file_s'))} | {f(r.get('steady_audio_per_s'))} | {sp[0]} | {sp[1]} | "
                       f"{f(r.get('tail_s'))} | {f(r.get('writing_s'))} | {same} |")
        out.append("")
    serve_runs = [r for r in runs if r["part"] == "serve"]
    if serve_runs:
        o = result["options"]
        reads = "greedy" if o.get("greedy") else "seeded"
        out.append(f"Serving, streamed reads (pcm, {reads}), --batch {o['serve_batch']} per replica, "
                   f"{o['requests']} requests per client one after another:\n")
        out.append("| server | GPUs | clients | TTFA p50 / p90 (ms) | aggregate audio s/s | against 1 replica "
                   "| errors |")
        out.append("|---|---|---|---|---|---|---|")
        one = next((r for r in serve_runs if r.get("replicas") == 1 and r.get("loads")), None)
        for r in serve_runs:
            if "error" in r and not r.get("loads"):
                out.append(f"| {r['label']} | {r.get('gpus') or '-'} | failed: {r['error'][:80]} ||||")
                continue
            for ld in r["loads"]:
                base = None if one is None else next((x for x in one["loads"] if x["clients"] == ld["clients"]), None)
                ratio = "-" if not base or not base["audio_per_s"] or not ld["audio_per_s"] else \
                    f"{ld['audio_per_s'] / base['audio_per_s']:.2f}x"
                out.append(f"| {r['label']} | {r.get('gpus') or '-'} | {ld['clients']} | {f(ld['ttfa_p50_ms'])} / "
                           f"{f(ld['ttfa_p90_ms'])} | {f(ld['audio_per_s'])} | {ratio} | {ld['errors']} |")
        out.append("")
    other = [r for r in runs if r["part"] in ("cluster", "kill")]
    if other:
        out.append("Cluster and faults:\n")
        out.append("| run | GPUs | result |")
        out.append("|---|---|---|")
        for r in other:
            if "error" in r:
                verdict = f"failed: {r['error'][:120]}"
            elif "kill" in r:
                k = r["kill"]
                verdict = (f"{k['streams']} streams, replica {k['killed_pid']} killed: {k['whole']} whole, "
                           f"{k['failed']} failed ({'; '.join(k['errors'])[:100]}); whole streams equal to a resend: "
                           f"{k['whole_checked'] - len(k['whole_but_different'])}/{k['whole_checked']}; "
                           f"later requests {'succeed' if k['later_requests_ok'] else 'FAIL'}")
            else:
                same = "-" if ref is None else sum(ref["hashes"].get(k) == v for k, v in r["hashes"].items())
                verdict = (f"{r['items']} items, each exactly once: {'yes' if r['exactly_once'] else 'NO'}; "
                           f"files equal to in-process: {same}/{len(r['hashes'])}; wall {f(r['wall_s'])} s"
                           + (f"; replica {r['killed_pid']} killed" if r.get("killed_pid") else
                              "; NO REPLICA KILLED (the job ended first: a larger --subset)" if "killed_pid" in r else "")
                           + (f"; replicas on GPUs {', '.join(r['gpus_seen'])}"
                              if r.get("gpus_seen") and r["gpus_seen"] != ["None"] else ""))
            out.append(f"| {r['label']} | {r.get('gpus') or '-'} | {verdict} |")
        out.append("")
    return "\n".join(out)


def describe() -> str:
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        gpu = f"{len(gpu)} x {gpu[0]}"
    except (OSError, IndexError, subprocess.TimeoutExpired):
        gpu = "no NVIDIA GPU"
    versions = []
    for mod in ("torch", "ray"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            versions.append(f"{mod} missing")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    return (f"{gpu}, {os.cpu_count()} CPUs, {', '.join(versions)}, Python {platform.python_version()}, "
            f"commit {commit or '-'}, {datetime.date.today().isoformat()}")


def main() -> None:
    if sys.argv[1:2] == ["--run"]:
        return child(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (or hub repo id); or --random-weights")
    ap.add_argument("--random-weights", action="store_true",
                    help="the full-size model drawn on each GPU, lengths forced")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--parts", default="bulk,serve,cluster,kill", help="comma-separated: bulk, serve, cluster, kill")
    ap.add_argument("--items", type=int, default=2400, help="bulk items")
    ap.add_argument("--sentences", default="1-3", help="texts (read sentences) per bulk item, MIN-MAX")
    ap.add_argument("--texts", help="a file of texts, one a line, instead of the bench's read sentences")
    ap.add_argument("--long-text", default=LONG_TEXT, help="what the streams of the Serve kill test read")
    ap.add_argument("--greedy", action="store_true", help="greedy reads (a dry run on the tiny model, whose sampled "
                    "reads are long) [default: seeded]")
    ap.add_argument("--batch", type=int, default=64, help="bulk --batch (rows a model generates at once)")
    ap.add_argument("--replicas", default="1,2,4", help="Ray replica counts (bulk and serve)")
    ap.add_argument("--clients", default="1,16,64", help="concurrent streaming clients, comma-separated")
    ap.add_argument("--requests", type=int, default=2, help="reads each client sends, one after another")
    ap.add_argument("--serve-batch", type=int, default=16, help="serve --batch: rows per replica")
    ap.add_argument("--subset", type=int, default=256, help="items of the cluster and bulk-kill runs (the shortest)")
    ap.add_argument("--parallel", action="store_true", help="run what fits on disjoint GPUs at the same time")
    ap.add_argument("--on-cluster", action="store_true",
                    help="each Ray bulk run joins a one-node cluster started on its GPUs before it (not timed), "
                         "as a job on a running cluster does [default: its own local Ray, started in its time]")
    ap.add_argument("--gpus", type=int, default=None,
                    help="GPUs to use [default: all nvidia-smi lists; 1 slot on a CPU]")
    ap.add_argument("--timeout", type=float, default=480, help="seconds a run may take")
    ap.add_argument("--deadline", type=float, default=None,
                    help="start no run, and end every run, this many seconds in")
    ap.add_argument("--json", help="every sample, rewritten after each run")
    ap.add_argument("--work", help="directory for the runs' files [default: a temporary one, removed]")
    ap.add_argument("--report", help="print the tables of a --json file and exit")
    opts = ap.parse_args()
    if opts.report:
        print(tables(json.loads(Path(opts.report).read_text())))
        return
    if not opts.model and not opts.random_weights:
        ap.error("give --model DIR or --random-weights")
    opts.parts = [p for p in opts.parts.split(",") if p]
    unknown = set(opts.parts) - {"bulk", "serve", "cluster", "kill"}
    if unknown:
        ap.error(f"unknown part(s): {', '.join(sorted(unknown))}")
    opts.replicas = [int(n) for n in opts.replicas.split(",") if n]
    low, _, high = opts.sentences.partition("-")
    counts = (int(low), int(high or low))
    on_gpu = opts.device != "cpu" and gpu_count() > 0
    slots = opts.gpus if opts.gpus is not None else (gpu_count() if on_gpu else 1)
    t_start = time.monotonic()
    work = Path(opts.work or tempfile.mkdtemp(prefix="scale-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    pool = [t.strip() for t in Path(opts.texts).read_text().splitlines() if t.strip()] if opts.texts else sentences()
    rows = job_rows(opts.items, counts, pool)
    items = work / "items.jsonl"
    items.write_text("".join(json.dumps(r) + "\n" for r in rows))
    keep = set(subset_ids(rows, opts.batch, opts.subset))
    subset = work / "subset.jsonl"
    subset.write_text("".join(json.dumps(r) + "\n" for r in rows if r["id"] in keep))
    runs = plan_runs(opts, slots, on_gpu)
    plan = groups(runs, slots, opts.parallel)
    result = {"environment": describe(), "options": {**vars(opts), "items": opts.items, "sentences": opts.sentences},
              "groups": [], "runs": []}

    def save() -> None:
        if opts.json:
            tmp = Path(opts.json + ".partial")
            tmp.write_text(json.dumps(result, indent=1) + "\n")
            os.replace(tmp, opts.json)

    clients = [int(c) for c in opts.clients.split(",") if c]
    signal.signal(signal.SIGTERM, stop_all)
    try:
        measure(opts, plan, result, save, work, items, subset, pool, clients, slots, on_gpu, t_start)
    except KeyboardInterrupt:
        kill_running()
        print("scale_bench: stopped; the tables hold what was measured", file=sys.stderr)
    order = {r["label"]: i for i, r in enumerate(runs)}
    result["runs"].sort(key=lambda r: order.get(r["label"], 99))
    save()
    print(tables(result))
    if not opts.work:
        shutil.rmtree(work, ignore_errors=True)


def measure(opts, plan, result, save, work, items, subset, pool, clients, slots, on_gpu, t_start) -> None:
    """The groups of runs, one after another; the runs of a group at once, each in its own process."""
    k = 0
    for group in plan:
        left = None if opts.deadline is None else opts.deadline - (time.monotonic() - t_start)
        if left is not None and left < 60:
            for r in group:
                result["runs"].append({"label": r["label"], "part": r["part"], "error": "not run: past --deadline"})
            continue
        assign(group, slots, on_gpu)
        result["groups"].append([r["label"] for r in group])
        print(f"scale_bench: {' + '.join(r['label'] for r in group)}", file=sys.stderr, flush=True)
        specs = []
        for r in group:
            k += 1
            d = work / f"run-{k:02d}"
            spec = {**r, "timeout": min(opts.timeout, left - 30) if left is not None else opts.timeout,
                    "items": str(subset if r.get("subset") else items), "out": str(d / "out"),
                    "clients": r.get("clients", clients), "requests": opts.requests, "texts": pool,
                    "long_text": opts.long_text, "greedy": opts.greedy}
            specs.append((spec, d))
        with concurrent.futures.ThreadPoolExecutor(len(specs)) as executor:
            futures = {executor.submit(launch, spec, d): spec for spec, d in specs}
            for fut in concurrent.futures.as_completed(futures):
                try:
                    r = fut.result()
                except Exception as e:  # (the tool's own fault: recorded, the other runs go on)
                    spec = futures[fut]
                    r = {"label": spec["label"], "part": spec["part"], "error": f"{type(e).__name__}: {e}"}
                result["runs"].append(r)
                print(f"scale_bench: {r['label']}: {'failed: ' + r['error'][:200] if 'error' in r else 'done'} "
                      f"({r.get('run_s', 0):.0f} s)", file=sys.stderr, flush=True)
                save()


if __name__ == "__main__":
    main()
