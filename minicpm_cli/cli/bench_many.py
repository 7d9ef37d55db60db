"""`minicpm bench --concurrency N`: many streams at once, measured.

With `concurrency` N, N requests of a workload start together (in one batch of
streams here, or as N simultaneous HTTP requests to a server), `runs` times: TTFA per request from
the common start to its first audio, RTF per stream (its end over its audio), and the aggregate
audio seconds per wall second. With `arrival_rate` R they arrive spread over time instead, as a
Poisson process of R requests a second (`arrivals`: exponential gaps from a fixed seed, so every run
and every backend sees the same moments): each one joins the batch in flight when it arrives (here:
submitted at its moment between the engine's rounds; to a server: sent then), and its TTFA and RTF
count from its own arrival, the wait for admission included. The `bulk` workload reads BULK_LINES
lines with up to N in flight, as `say --lines --dir --batch N` does, and reports the aggregate only;
its warm-up reads every line once (with other seeds).

The single-stream workloads, timers, records and tables it builds on are `cli.bench`'s.
"""

from __future__ import annotations

import datetime
import gc
import random
import time
from collections.abc import Callable

import torch

from ..engine import loading
from ..engine.loading import environment
from ..engine.sampling import Sampling
from .bench import (BenchOptions, Clock, bulk_lines, cell, device_line, http_sample, log, percentile, request_stream,
                    workload_texts)


def arrivals(n: int, rate: float | None, seed: int = 0) -> list[float]:
    """The moments (seconds from the first) at which n requests arrive: all at 0 without a rate, else
    a Poisson process of `rate` a second (exponential gaps drawn from `seed`; the first at 0)."""
    if rate is None:
        return [0.0] * n
    rng = random.Random(seed)
    out = [0.0]
    for _ in range(n - 1):
        out.append(out[-1] + rng.expovariate(rate))
    return out


def run_arriving(engine, moments: list[float], submit: Callable[[int], None], t0: float) -> None:
    """Submit stream k (`submit(k)`) once `moments[k]` seconds have passed since t0 (perf_counter),
    between the engine's rounds, sleeping while it has nothing to compute; then run it to the end."""
    for k, at in enumerate(moments):
        while time.perf_counter() - t0 < at:
            if engine.idle:  # nothing to compute until this arrival
                time.sleep(max(0.0, at - (time.perf_counter() - t0)))
            else:
                engine.round()
        submit(k)
    engine.run()


def streams_together(synth, workload: str, n: int, seed: int, opts: BenchOptions, clock: Clock) -> list[dict]:
    """n requests of `workload` in one batch, started together or at their `arrivals` -> one record
    each (times from each one's arrival)."""
    from ..engine.batching import Stream

    items = workload_texts(workload)
    engine = synth.batch(n)
    recs = [{"text": items[k % len(items)], "seed": seed + k, "first": None, "end": None, "samples": 0,
             "error": None, "arrival": at} for k, at in enumerate(arrivals(n, opts.arrival_rate, seed))]

    def sink(rec, chunk):
        if rec["first"] is None and len(chunk.samples):
            rec["first"] = clock.now()
        rec["samples"] += len(chunk.samples)

    def done(rec, error):
        rec["end"], rec["error"] = clock.now(), error

    def submit(k: int) -> None:
        r = recs[k]
        engine.submit(Stream(lambda lane: request_stream(synth, workload, r["text"], r["seed"], opts, lane),
                             lambda c: sink(r, c), lambda e: done(r, e)))

    clock.sync()
    t0 = clock.now()
    run_arriving(engine, [r["arrival"] for r in recs], submit, t0)
    return _records(recs, t0, synth.sample_rate)


def _records(recs: list[dict], t0: float, rate: int) -> list[dict]:
    """Each request's audio, TTFA, end and RTF, times from its arrival (t0 + its `arrival`)."""
    failed = [r["error"] for r in recs if r["error"] is not None]
    if failed:
        raise failed[0]
    out = []
    for r in recs:
        audio, start = r["samples"] / rate, t0 + r["arrival"]
        out.append({"text": r["text"], "seed": r["seed"], "audio_s": audio, "arrival_s": r["arrival"],
                    "ttfa_ms": None if r["first"] is None else (r["first"] - start) * 1e3,
                    "total_s": r["end"] - start, "rtf": (r["end"] - start) / audio if audio else None})
    return out


def _summary(samples: list[dict], wall: float) -> dict:
    ttfa = [s["ttfa_ms"] for s in samples if s["ttfa_ms"] is not None]
    rtf = [s["rtf"] for s in samples if s["rtf"] is not None]
    return {"ttfa_ms": {"p50": percentile(ttfa, 0.5), "p90": percentile(ttfa, 0.9)},
            "rtf": {"p50": percentile(rtf, 0.5), "p90": percentile(rtf, 0.9)},
            "audio_s_per_s": sum(s["audio_s"] for s in samples) / wall if wall else None}


def concurrent(opts: BenchOptions) -> dict:
    """The workloads with `opts.concurrency` streams at once (see the module's docstring)."""
    n = opts.concurrency
    if opts.server is not None:
        return _concurrent_server(opts)
    from ..engine.pipeline import Synthesizer, resolve_device

    device = resolve_device(opts.device)
    clock = Clock(device)
    result = {"environment": environment(device), "options": {**opts.__dict__},
              "forced_lengths": opts.random_weights, "concurrency": n, "results": []}
    forced = loading.FORCED_FRAMES_PER_TOKEN if opts.random_weights else None
    for backend in opts.backends:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        log(f"{backend}: loading for {n} streams")
        synth = Synthesizer.load(opts.model, backend=backend, device=opts.device, dtype=opts.dtype,
                                 random_weights=opts.random_weights, gguf=opts.gguf if backend == "gguf" else None,
                                 rows=n, batch_invariant=not opts.batch_variant)
        for workload in opts.workloads:
            t = clock.now()
            if workload == "bulk":
                lines = bulk_lines(opts.bulk_lines)
                # every line once with other seeds: the shapes a run reaches (prompt groups, prefills,
                # the int4 kernels' tiles) compiled and captured before the timed runs (with only the
                # first 2N lines, the first timed run at 16 streams took 19 s where the others took 11)
                warm = [(line, Sampling(seed=10_000 + i)) for i, line in enumerate(lines)]
                for _ in range(opts.warmup):
                    for _ in synth.say_many(warm, batch=n, frames_per_token=forced):
                        pass
                warmup_s = clock.now() - t
                walls, audio = [], 0.0
                for r in range(opts.runs):
                    clock.sync()
                    t0 = clock.now()
                    for chunks in synth.say_many([(line, Sampling(seed=r * len(lines) + i)) for i, line in
                                                  enumerate(lines)], batch=n, frames_per_token=forced):
                        audio += sum(len(c.samples) for c in chunks) / synth.sample_rate
                    walls.append(clock.now() - t0)
                    log(f"{backend} bulk x{n}: run {r + 1}/{opts.runs}")
                entry = {"ttfa_ms": {"p50": None, "p90": None}, "rtf": {"p50": None, "p90": None},
                         "audio_s_per_s": audio / sum(walls), "lines": len(lines), "wall_s": walls}
            else:
                for i in range(opts.warmup):
                    streams_together(synth, workload, n, 10_000 + i * n, opts, clock)
                warmup_s = clock.now() - t
                samples, wall = [], 0.0
                for r in range(opts.runs):
                    recs = streams_together(synth, workload, n, r * n, opts, clock)
                    samples += recs
                    wall += max(s["arrival_s"] + s["total_s"] for s in recs)
                    log(f"{backend} {workload} x{n}: run {r + 1}/{opts.runs}")
                entry = {**_summary(samples, wall), "samples": samples}
            entry.update({"backend": backend, "workload": workload, "streams": n, "warmup_s": warmup_s,
                          "peak_gpu_gib": (torch.cuda.max_memory_allocated(device)
                                           + getattr(synth.llm, "extra_gpu_bytes", 0)) / 2**30
                          if device.type == "cuda" else None,
                          # (what MINICPM_MEMORY_CAP bounds: the allocator's reserve, not the tensors alone)
                          "reserved_gpu_gib": torch.cuda.max_memory_reserved(device) / 2**30
                          if device.type == "cuda" else None})
            result["results"].append(entry)
        del synth
        gc.collect()
    return result


def _concurrent_server(opts: BenchOptions) -> dict:
    """N simultaneous HTTP requests (threads), each timed from the common start."""
    from concurrent.futures import ThreadPoolExecutor

    from ..serving.client import Remote

    n = opts.concurrency
    remote = Remote.find(opts.server, explicit=True)
    props = remote.props
    env = {**props.get("environment", {}), "server": remote.url, "server_version": props.get("version"),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    result = {"environment": env, "options": {**opts.__dict__}, "forced_lengths": bool(props.get("forced_lengths")),
              "concurrency": n, "results": []}

    def together(workload: str, seed: int) -> list[dict]:
        """(each request is timed from its own send; the n threads send at once, or each at its
        arrival)"""
        items = workload_texts(workload)
        moments = arrivals(n, opts.arrival_rate, seed)
        t0 = time.perf_counter()

        def one(k: int) -> dict:
            time.sleep(max(0.0, moments[k] - (time.perf_counter() - t0)))
            return {**http_sample(remote, workload, items[k % len(items)], seed + k, opts), "arrival_s": moments[k]}

        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(one, range(n)))

    for workload in [w for w in opts.workloads if w != "bulk"]:
        t = time.perf_counter()
        for i in range(opts.warmup):
            together(workload, 10_000 + i * n)
        warmup_s = time.perf_counter() - t
        samples, wall = [], 0.0
        for r in range(opts.runs):
            t0 = time.perf_counter()
            samples += together(workload, r * n)
            wall += time.perf_counter() - t0  # (from the first send to the last end)
            log(f"server {workload} x{n}: run {r + 1}/{opts.runs}")
        result["results"].append({**_summary(samples, wall), "samples": samples, "backend": f"{props['backend']} (server)",
                                  "workload": workload, "streams": n, "warmup_s": warmup_s, "peak_gpu_gib": None})
    return result


def concurrency_table(result: dict) -> str:
    lines = [
        device_line(result),
        "",
        "| backend | workload | streams | TTFA p50 / p90 (ms) | per-stream RTF p50 / p90 | audio s per wall s "
        "| peak GPU (GiB) | warm-up (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in result["results"]:
        lines.append(
            f"| {e['backend']} | {e['workload']} | {e['streams']} | {cell(e['ttfa_ms']['p50'], '.1f')} / "
            f"{cell(e['ttfa_ms']['p90'], '.1f')} | {cell(e['rtf']['p50'], '.3f')} / {cell(e['rtf']['p90'], '.3f')} "
            f"| {cell(e['audio_s_per_s'], '.1f')} | {cell(e['peak_gpu_gib'], '.1f')} | {e['warmup_s']:.1f} |")
    rate = result["options"].get("arrival_rate")
    if rate:
        lines += ["", f"Arrivals: {rate:g} requests a second (a seeded Poisson process), each timed from its arrival "
                  "(bulk: N in flight)."]
    if result.get("forced_lengths"):
        lines += ["", "Forced lengths (random weights): "
                  f"{loading.FORCED_REPLY_TOKENS} LLM tokens a reply, {loading.FORCED_FRAMES_PER_TOKEN} frames per TTS text token."]
    return "\n".join(lines) + "\n"
