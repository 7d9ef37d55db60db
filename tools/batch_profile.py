"""Where the time of a batch goes: N reads (or replies) started together, each stage timed.

    python tools/batch_profile.py [--streams 16] [--workload read|reply|bulk] [--lines N] [--backend compile]
                                  [--arrival-rate R] [--cprofile [FILE]] [--timeline] [--stalls RUNS]

Full-size random weights, lengths forced as `bench --random-weights` forces them. After a warm-up
batch, one batch runs with every stage wrapped in a device-synchronised timer (so the total is
longer than an untimed run's): the batched TTS steps and LLM tokens, the prefills of each stream
(LLM prompt, TTS text chunks), the codec, and what is left (host work between them). With
--arrival-rate R the streams arrive as `bench --arrival-rate` makes them (their first audio then
counts from each one's arrival). With --cprofile, a second batch runs under cProfile (host time by
function; with a FILE, its profile dumped there for pstats). With --stalls RUNS, RUNS
untimed batches (as bench runs them, seeds moving on) each report their wall time and what paused
them: CUDA graphs captured mid-run (key and time), frames torch.compile compiled, garbage
collections over 20 ms.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import cProfile
import pstats
import time

import torch

from minicpm_cli.cli import bench as b
from minicpm_cli.cli import bench_many
from minicpm_cli.engine.batching import Engine, Stream
from minicpm_cli.engine.pipeline import Synthesizer


EVENTS: list = []  # (stage, start, end), perf_counter seconds, for --timeline


def wrap(obj, name: str, totals: dict, key: str) -> None:
    fn = getattr(obj, name)

    def timed(*args, **kwargs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        end = time.perf_counter()
        totals[key][0] += 1
        totals[key][1] += end - t
        EVENTS.append((key, t, end))
        return out

    setattr(obj, name, timed)


def batch(synth, workload: str, n: int, opts, lines: int | None = None) -> float:
    if workload == "bulk":
        from minicpm_cli.engine.loading import FORCED_FRAMES_PER_TOKEN
        from minicpm_cli.engine.sampling import Sampling

        t = time.perf_counter()
        for _ in synth.say_many([(line, Sampling(seed=i)) for i, line in enumerate(b.bulk_lines(lines or 4 * n))], batch=n,
                                frames_per_token=FORCED_FRAMES_PER_TOKEN):
            pass
        return time.perf_counter() - t
    engine = synth.batch(n)
    items = b.workload_texts(workload)
    firsts: list = []  # (stream, time) of every chunk with samples
    moments = bench_many.arrivals(n, opts.arrival_rate)

    def submit(k: int) -> None:
        engine.submit(Stream(lambda lane, k=k: b.request_stream(synth, workload, items[k % len(items)], k, opts, lane),
                             lambda chunk, k=k: firsts.append((k, time.perf_counter())) if len(chunk.samples) else None))

    EVENTS.clear()
    t = time.perf_counter()
    bench_many.run_arriving(engine, moments, submit, t)
    torch.cuda.synchronize()
    batch.start, batch.firsts = t, {}
    for k, at in firsts:
        batch.firsts.setdefault(k, at - t - moments[k])  # (seconds from its arrival)
    return time.perf_counter() - t


def stalls(synth, args, opts) -> None:
    """args.stalls batches (the workload's seeds moving on as bench's runs do), each with its wall time
    and the pauses inside it."""
    import gc

    from minicpm_cli.backends import compile as backend
    from torch._dynamo.utils import counters

    events: list = []
    run = backend.Graphs.run

    def timed_run(self, key, fn):
        if not self.cuda or key in self.graphs:
            return run(self, key, fn)
        t = time.perf_counter()
        out = run(self, key, fn)
        events.append(f"capture {key!r} {(time.perf_counter() - t) * 1e3:.0f} ms")
        return out

    backend.Graphs.run = timed_run
    gc_start: list = []

    def on_gc(phase, info):
        if phase == "start":
            gc_start[:] = [time.perf_counter()]
        elif gc_start and (ms := (time.perf_counter() - gc_start[0]) * 1e3) > 20:
            events.append(f"gc generation {info['generation']} {ms:.0f} ms")

    gc.callbacks.append(on_gc)
    clock = b.Clock(torch.device("cuda"))
    for r in range(args.stalls):
        events.clear()
        frames = sum(counters["frames"].values())
        t = time.perf_counter()
        if args.workload == "bulk":
            batch(synth, "bulk", args.streams, opts, args.lines)
        else:
            recs = bench_many.streams_together(synth, args.workload, args.streams, (r + 1) * args.streams, opts, clock)
        wall = time.perf_counter() - t
        extra = "" if args.workload == "bulk" else \
            f", RTF max {max(x['rtf'] for x in recs):.3f}, TTFA max {max(x['ttfa_ms'] for x in recs):.0f} ms"
        compiled = sum(counters["frames"].values()) - frames
        print(f"run {r + 1}: {wall * 1e3:.0f} ms{extra}; torch.compile frames {compiled}; "
              f"{'; '.join(events) or 'no captures, no long collections'}", flush=True)
    gc.callbacks.remove(on_gc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--workload", default="read")
    ap.add_argument("--backend", default="compile")
    ap.add_argument("--lines", type=int, default=None, help="bulk: lines read (default 4 x streams)")
    ap.add_argument("--fifo", action="store_true", help="bulk: lines start in input order (sizes ignored)")
    ap.add_argument("--stalls", type=int, default=0, metavar="RUNS", help="RUNS untimed batches, each with its "
                    "mid-run graph captures, torch.compile frames and long garbage collections")
    ap.add_argument("--arrival-rate", type=float, default=None, help="streams arriving at R a second (read, reply)")
    ap.add_argument("--cprofile", nargs="?", const="", default=None, metavar="FILE",
                    help="a batch under cProfile: its top functions (and with FILE, pstats' dump of it there)")
    ap.add_argument("--timeline", action="store_true", help="the timed batch's stages in order, until the last "
                    "stream's first audio (ms from the start; gaps are host work)")
    args = ap.parse_args()
    if args.fifo:
        read_job = Synthesizer.read_job
        Synthesizer.read_job = lambda *a, **k: dataclasses.replace(read_job(*a, **k), size=0)
    opts = b.BenchOptions(backends=(args.backend,), random_weights=True, arrival_rate=args.arrival_rate)
    synth = Synthesizer.load(None, backend=args.backend, random_weights=True, rows=args.streams)
    batch(synth, args.workload, args.streams, opts, args.lines)  # warm-up: graphs captured here
    plain = batch(synth, args.workload, args.streams, opts, args.lines)
    if args.stalls:
        stalls(synth, args, opts)
        return
    totals = collections.defaultdict(lambda: [0, 0.0])
    wrap(synth.tts, "step_calls", totals, "tts batched step")
    wrap(synth.tts, "prefill_row", totals, "tts prefill")
    wrap(synth.tts, "prefill_rows", totals, "tts batched prefill")
    wrap(synth.llm, "prefill_rows", totals, "llm batched prompts")
    wrap(synth.codec, "decode_batch", totals, "codec batched")
    wrap(synth.tts, "prefill_audio_row", totals, "tts prefill audio")
    wrap(synth.llm, "decode_rows", totals, "llm batched token")
    wrap(synth.llm, "forward_row", totals, "llm prefill / single")
    wrap(synth.codec, "decode", totals, "codec")
    wrap(Engine, "pick_tokens", totals, "llm token choice")
    timed = batch(synth, args.workload, args.streams, opts, args.lines)
    print(f"{args.streams} x {args.workload} ({args.backend}, {torch.cuda.get_device_name()}): {plain * 1e3:.0f} ms "
          f"untimed, {timed * 1e3:.0f} ms with timers")
    rest = timed
    for key, (count, secs) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        rest -= secs
        print(f"  {key:22s} {count:6d} calls {secs * 1e3:8.1f} ms  {secs / count * 1e3:7.3f} ms/call")
    print(f"  {'rest (host)':22s} {'':6s}       {rest * 1e3:8.1f} ms")
    if args.workload != "bulk":
        print(f"  first audio, ms from each stream's arrival: {sorted(round(x * 1e3) for x in batch.firsts.values())}")
    if args.timeline and args.workload != "bulk":
        t0 = batch.start
        moments = bench_many.arrivals(args.streams, args.arrival_rate)
        last = t0 + max(x + moments[k] for k, x in batch.firsts.items())
        prev = t0
        for key, start, end in EVENTS:
            if start > last:
                break
            print(f"  {(start - t0) * 1e3:8.1f} +{(start - prev) * 1e3:6.1f} gap  {key:22s} {(end - start) * 1e3:7.2f} ms")
            prev = end
    if args.cprofile is not None:
        prof = cProfile.Profile()
        prof.enable()
        batch(synth, args.workload, args.streams, opts, args.lines)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        if args.cprofile:
            prof.dump_stats(args.cprofile)


if __name__ == "__main__":
    main()
