"""Time a whole segment's codec decode (DVAE decoder + Vocos) per row on the full-size codec with
random weights: one row eagerly (as the batch-invariant mode decodes a segment of more than
GraphCodec.GRAPH_FRAMES frames), one row replayed from a CUDA graph, CODEC_BATCH rows in a graph (as
segments of up to 512 frames were decoded before 0d86fc8), and 16 rows one after another eagerly
(what 16 finished lines of one length cost now). Also says whether the one-row graph gives the eager
decode's bits (a graph for a length met again must, to keep a seed's audio the same at any load).

    python tools/codec_cost.py [--frames 100 300 600] [--reps 7]

Each figure is the median of --reps runs, synchronized, with the host's time for the call apart
(where the host's time is close to the whole, the decode waits on its launches).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, reps: int) -> tuple[float, float]:
    """(median ms to the device's end, median ms the host spent in fn) over reps runs."""
    total, host = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        total.append(time.perf_counter() - t0)
        host.append(t1 - t0)
    return statistics.median(total) * 1e3, statistics.median(host) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, nargs="+", default=[100, 300, 600])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("codec_cost.py times CUDA decodes: no CUDA device here")
    from minicpm_cli.backends.compile import Graphs
    from minicpm_cli.backends.invariant import CODEC_BATCH
    from minicpm_cli.engine.pipeline import Synthesizer

    synth = Synthesizer.load(None, backend="compile", random_weights=True, rows=1)
    eager = synth.codec.decode.__self__.batch_eager  # (the codec's own decode_batch, under GraphCodec)
    nvq = synth.codec.num_vq
    print(f"{torch.cuda.get_device_name()}: ms a decode (host ms in brackets)")
    with torch.inference_mode():
        for t in args.frames:
            one = torch.randint(0, 600, (1, t, nvq), device="cuda")
            group = torch.randint(0, 600, (CODEC_BATCH, t, nvq), device="cuda")
            many = torch.randint(0, 600, (16, t, nvq), device="cuda")
            e1 = timed(lambda: eager(one), args.reps)
            graphs = Graphs(one.device)  # (the product's: two warm-up runs, a capture, then replays)
            out1 = graphs.run("one", lambda: eager(one))
            r1 = timed(lambda: graphs.run("one", lambda: eager(one)), args.reps)
            same = torch.equal(out1, eager(one))
            graphs.run("group", lambda: eager(group))  # (captured before it is timed)
            r8 = timed(lambda: graphs.run("group", lambda: eager(group)), args.reps)
            e16 = timed(lambda: [eager(row[None]) for row in many], max(3, args.reps // 2))
            print(f"{t} frames: one row eager {e1[0]:.2f} [{e1[1]:.2f}], one-row graph {r1[0]:.2f} "
                  f"(the eager bits: {same}), {CODEC_BATCH}-row graph {r8[0]:.2f} ({r8[0] / CODEC_BATCH:.2f} a row), "
                  f"16 rows one by one eagerly {e16[0]:.2f} [{e16[1]:.2f}]", flush=True)


if __name__ == "__main__":
    main()
