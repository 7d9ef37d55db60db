"""The same seeded (and greedy) work alone and under load, through the paths users take, its bytes
compared for equality: `minicpm serve` under concurrent clients, and `minicpm bulk` at several
`--batch` sizes and Ray replica counts. `tools/batch_parity.py` checks the engine itself; this checks
what a server's client and a bulk job's files get.

    python tools/load_parity.py [--backend compile] [--skip serve|bulk] [--model DIR]
                                [--targets 16] [--others 48] [--items 64] [--alone-items 16]
                                [--batches 16 64] [--replicas 1 2] [--in-process] [--json FILE]

Serve (`serve --model DIR`, or `--random-weights` with lengths forced as the bench forces them): --targets speech requests
(the bench's read texts; even ones seeded, odd ones greedy; pcm, streamed and not) sent one at a time,
then all at once among --others concurrent requests (their own texts and seeds), a third of the
targets sent while the others are mid-flight. Bulk (needs --model, a checkpoint directory, e.g. from
tools/write_full_checkpoint.py): --items lines (the bench's read texts cut into sentences), `--seed 7`,
with each --batches size, each --replicas count (`--ray auto --gpus-per-replica 1`), and `--batch 1`
over the first --alone-items lines; every file compared with the largest batch's. `--in-process`:
the same reads at each batch size in this one process, codes and samples compared apart. Prints a
Markdown table: configuration, requests or files equal / total.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale_bench import KEY, bulk, describe, sentences, start_server, stop_server  # noqa: E402


def speech(port: int, body: dict) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    conn.request("POST", "/v1/audio/speech", body=json.dumps({"model": "tts-1", "voice": "default", **body}),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if resp.status != 200:
        raise SystemExit(f"request failed: {resp.status} {data[:300]!r}")
    return data


def serve_rows(model: str | None, backend: str, targets: int, others: int, variant: bool) -> list[tuple[str, int, int]]:
    texts = sentences()
    reqs = [{"input": texts[k % len(texts)], "response_format": "pcm",
             **({"seed": 100 + k} if k % 2 == 0 else {"greedy": True}),
             **({"stream_format": "audio"} if k % 4 < 2 else {})} for k in range(targets)]
    crowd = [{"input": texts[(7 * i + 3) % len(texts)], "response_format": "pcm", "seed": 5000 + i,
              **({"stream_format": "audio"} if i % 2 else {})} for i in range(others)]
    proc, port, _ = start_server([*(["--model", model] if model else ["--random-weights"]), "--backend", backend, *(["--batch-variant"] if variant else [])])
    try:
        for body in reqs[:2]:  # warm-up: compilation and first use
            speech(port, body)
        alone = [speech(port, body) for body in reqs]
        got: dict = {}
        jobs = [("t", k, b) for k, b in enumerate(reqs)] + [("o", i, b) for i, b in enumerate(crowd)]
        random.Random(0).shuffle(jobs)
        late = {("t", k) for k in range(0, targets, 3)}  # these join once the others run
        barrier = threading.Barrier(len(jobs))

        def worker(kind, k, body):
            barrier.wait()
            if (kind, k) in late:
                time.sleep(0.5)
            got[(kind, k)] = speech(port, body)

        threads = [threading.Thread(target=worker, args=j) for j in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seeded = [k for k in range(targets) if k % 2 == 0]
        greedy = [k for k in range(targets) if k % 2 == 1]
        return [(f"serve, among {others} concurrent ({kind})", sum(got[("t", k)] == alone[k] for k in ks), len(ks))
                for kind, ks in (("seeded", seeded), ("greedy", greedy))]
    finally:
        stop_server(proc)


def bulk_rows(model: str, backend: str, items: int, alone_items: int, batches: list[int], replicas: list[int],
              variant: bool) -> list[tuple[str, int, int]]:
    texts = sentences()
    lines = [texts[i % len(texts)] for i in range(items)]
    model_args = ["--model", model, "--backend", backend, *(["--batch-variant"] if variant else [])]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "all.txt").write_text("\n".join(lines) + "\n")
        (tmp / "head.txt").write_text("\n".join(lines[:alone_items]) + "\n")
        runs = {}
        for b in sorted(batches, reverse=True):
            runs[f"bulk --batch {b}"] = bulk(f"b{b}", tmp / "all.txt", tmp / f"b{b}", model_args, ["--batch", str(b)])
        ref_name = f"bulk --batch {max(batches)}"
        ref = runs[ref_name]["files"]
        for n in replicas:
            runs[f"bulk --batch {max(batches)} --ray, {n} replica(s)"] = bulk(
                f"r{n}", tmp / "all.txt", tmp / f"r{n}", model_args,
                ["--batch", str(max(batches)), "--ray", "auto", "--replicas", str(n), "--gpus-per-replica", "1"])
        runs["bulk --batch 1 (first lines)"] = bulk("b1", tmp / "head.txt", tmp / "b1", model_args, ["--batch", "1"])
        for name, run in runs.items():
            if name == ref_name:
                continue
            files = run["files"]
            rows.append((f"{name} against {ref_name}", sum(ref.get(f) == data for f, data in files.items()), len(files)))
        rows.insert(0, (f"{ref_name}: files written", len(ref), items))
    return rows


def in_process_rows(model: str, backend: str, items: int, alone_items: int, batches: list[int],
                    variant: bool) -> list[tuple[str, int, int]]:
    """bulk's reads (`say_batch`'s jobs: segment decoding, lengths as the model gives them) in this
    process: `say_many` at each batch size and `say` alone for the first lines, each against the
    largest batch, codes and samples apart; tells a batch's effect from a process's."""
    import numpy as np
    import torch

    from minicpm_cli.engine.pipeline import Synthesizer
    from minicpm_cli.engine.sampling import Sampling

    top = max(batches)
    synth = Synthesizer.load(model, backend=backend, rows=top, batch_invariant=not variant)
    texts = sentences()
    reqs = [(texts[i % len(texts)], Sampling(seed=1000 + i)) for i in range(items)]

    def run(batch: int, n: int) -> list:
        outs = synth.say_many(reqs[:n], batch=batch) if batch > 1 else (
            list(synth.synthesize(t, s, decode="segment")) for t, s in reqs[:n])
        return [(torch.cat([c.codes for c in chunks]), np.concatenate([c.samples for c in chunks])) for chunks in outs]

    ref = run(top, items)
    rows = []
    for name, got in [(f"in one process: batch {top} again", run(top, items)),
                      *[(f"in one process: batch {b}", run(b, items)) for b in sorted(batches)[:-1]],
                      ("in one process: alone (first lines)", run(1, alone_items))]:
        codes = sum(len(c) == len(rc) and bool(torch.equal(c, rc)) for (c, _), (rc, _) in zip(got, ref))
        samples = sum(a.shape == ra.shape and bool(np.array_equal(a, ra)) for (_, a), (_, ra) in zip(got, ref))
        rows += [(f"{name} against batch {top}: codes", codes, len(got)),
                 (f"{name} against batch {top}: samples", samples, len(got))]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="compile")
    ap.add_argument("--variant", action="store_true", help="the batch-variant kernels")
    ap.add_argument("--skip", choices=("serve", "bulk"), action="append", default=[])
    ap.add_argument("--in-process", action="store_true",
                    help="also bulk's reads at each batch size in this process (needs --model)")
    ap.add_argument("--model", default=None, help="a checkpoint directory (bulk needs one)")
    ap.add_argument("--targets", type=int, default=16)
    ap.add_argument("--others", type=int, default=48)
    ap.add_argument("--items", type=int, default=64)
    ap.add_argument("--alone-items", type=int, default=16)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--replicas", type=int, nargs="*", default=[])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if ("bulk" not in args.skip or args.in_process) and not args.model:
        ap.error("bulk needs --model DIR (or --skip bulk)")
    rows = []
    if "serve" not in args.skip:
        rows += serve_rows(args.model, args.backend, args.targets, args.others, args.variant)
    if "bulk" not in args.skip:
        rows += bulk_rows(args.model, args.backend, args.items, args.alone_items, args.batches, args.replicas,
                          args.variant)
    if args.in_process:
        rows += in_process_rows(args.model, args.backend, args.items, args.alone_items, args.batches, args.variant)
    print(f"{describe()}; backend {args.backend}{' (batch-variant)' if args.variant else ''}\n")
    print("| configuration | equal / total |\n|---|---|")
    for name, eq, n in rows:
        print(f"| {name} | {eq}/{n} |")
    if args.json:
        Path(args.json).write_text(json.dumps([{"configuration": n, "equal": e, "total": t} for n, e, t in rows], indent=1))


if __name__ == "__main__":
    main()
