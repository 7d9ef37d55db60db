"""A bulk job's schedule simulated: how long N replicas take over the same items when the batches are
cut in input order or longest text first (`bulk.batches`), with one or two batches held per actor, and
replicas that become ready together or spread over some seconds. No model runs: the numbers are a
model's, for choosing a schedule before spending GPU time on it (docs/scale-out.md).

    python tools/bulk_schedule.py [--items 1200] [--batch 64] [--noise 0.3] [--spread 0,6]

The model: an item is `frames` TTS steps (10 a text token, as `--random-weights` forces, times a
log-normal factor of sigma --noise for the real model's spread); a replica's engine runs up to --batch
of its batch's items at once, each step costing STEP_S + ROW_S per busy row (the batched TTS step of
docs/benchmarks.md: 1.01 ms at 16 rows, 2.37 at 64), refilling rows longest first as items end
(`batching.in_order`), each admission a prompt prefill of PREFILL_S + PROMPT_S an item. A batch ends
with its last item; Ray Data hands the next batch to the actor with the fewest in flight, once the
driver sees a batch end (DISPATCH_S), up to `held` per actor.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minicpm_cli.scale import bulk  # noqa: E402

STEP_S, ROW_S = 0.56e-3, 0.0283e-3  # a batched TTS step: fixed + per busy row (seconds)
PREFILL_S, PROMPT_S = 0.010, 0.0012  # a round's prompt prefill: fixed + per item admitted
DISPATCH_S = 0.05  # from a batch's end on an actor to the next batch handed to it
TOKENS = (7, 16, 37, 47, 81)  # TTS tokens of the bench's read sentences


def job(n: int, noise: float, seed: int = 1) -> list[tuple[str, int]]:
    """(text, frames) for n items of one to three read sentences; the text's length is all a plan knows."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        picks = [rng.randrange(len(TOKENS)) for _ in range(rng.choice((1, 1, 2, 3)))]
        tokens = sum(TOKENS[p] for p in picks)
        out.append(("x" * (4 * tokens), max(1, round(10 * tokens * math.exp(rng.gauss(0, noise))))))
    return out


def batch_time(frames: list[int], rows: int) -> float:
    """One `say_batch` call: rows refilled as items end, the longest waiting first."""
    waiting, running, t = sorted(frames, reverse=True), [], 0.0
    while waiting or running:
        admitted = 0
        while waiting and len(running) < rows:
            running.append(waiting.pop(0))
            admitted += 1
        if admitted:
            t += PREFILL_S + PROMPT_S * admitted
        step = min(running)
        t += step * (STEP_S + ROW_S * len(running))
        running = [f - step for f in running if f > step]
    return t


def makespan(batches: list[list[int]], replicas: int, rows: int, held: int, ready: list[float]) -> float:
    """When the last batch ends: actors run their batches one after another, Ray Data hands out the
    next batch (in order) to the ready actor with the fewest in flight, at most `held` each."""
    queue, inflight, busy = list(batches), [[] for _ in range(replicas)], [None] * replicas
    events = [(r, a, "ready") for a, r in enumerate(ready)]
    heapq.heapify(events)
    end = 0.0
    while events:
        now, a, kind = heapq.heappop(events)
        if kind == "done":
            inflight[a].pop(0)
            busy[a] = None
            heapq.heappush(events, (now + DISPATCH_S, a, "dispatch"))
        while queue:
            free = [b for b in range(replicas) if ready[b] <= now and len(inflight[b]) < held]
            if not free:
                break
            inflight[min(free, key=lambda b: (len(inflight[b]), b))].append(queue.pop(0))
        for b in range(replicas):
            if busy[b] is None and inflight[b] and ready[b] <= now:
                busy[b] = now + batch_time(inflight[b][0], rows)
                heapq.heappush(events, (busy[b], b, "done"))
                end = max(end, busy[b])
    return end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--noise", type=float, default=0.3, help="sigma of the real lengths around the text's")
    ap.add_argument("--spread", default="0,6", help="seconds over which the replicas become ready, comma-separated")
    opts = ap.parse_args()
    items = job(opts.items, opts.noise)
    planned = [bulk.Item(str(k), text, f"{k}.wav", None) for k, (text, _) in enumerate(items)]
    frames = [f for _, f in items]
    plans = {"input order": [[frames[int(i.id)] for i in planned[k:k + opts.batch]]
                             for k in range(0, len(planned), opts.batch)],
             "longest first": [[frames[int(i.id)] for i in group] for group in bulk.batches(planned, opts.batch)]}
    ideal = sum(frames) * (STEP_S + ROW_S * opts.batch) / opts.batch
    print(f"{opts.items} items, batches of {opts.batch}, noise {opts.noise}; all rows busy all the time: "
          f"{ideal:.1f} s on one replica\n")
    print("| batches | ready over (s) | held per actor | 1 replica (s) | 2 replicas (s, speed-up) "
          "| 4 replicas (s, speed-up) |")
    print("|---|---|---|---|---|---|")
    for spread in (float(s) for s in opts.spread.split(",")):
        for name, plan in plans.items():
            for held in (1, 2):
                one = makespan(plan, 1, opts.batch, held, [0.0])
                cells = [f"{one:.1f}"]
                for n in (2, 4):
                    t = makespan(plan, n, opts.batch, held, [spread * a / (n - 1) for a in range(n)])
                    cells.append(f"{t:.1f} ({one / t:.2f}x)")
                print(f"| {name} | {spread:g} | {held} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
