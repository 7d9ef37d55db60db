"""`minicpm bench --concurrency N`: many streams at once, measured.

With `concurrency` N, N requests of a workload start together (in one batch of
streams here, or as N simultaneous HTTP requests to a server), `runs` times: TTFA per request from
the common start to its first audio, RTF per stream (its end over its audio), and the aggregate
audio seconds per wall second. The `bulk` workload reads BULK_LINES lines with up to N in flight, as
`say --lines --dir --batch N` does, and reports the aggregate only; its warm-up reads every line once
(with other seeds).

The single-stream workloads, timers, records and tables it builds on are `cli.bench`'s.
"""

from __future__ import annotations

import datetime
import gc
import time

import torch

from ..engine import loading
from ..engine.loading import environment
from ..engine.sampling import Sampling
from .bench import (BenchOptions, Clock, bulk_lines, cell, device_line, http_sample, log, percentile, request_stream,
                    workload_texts)


def streams_together(synth, workload: str, n: int, seed: int, opts: BenchOptions, clock: Clock) -> list[dict]:
    """n requests of `workload` started together in one batch -> one record each (times from the start)."""
    from ..engine.batching import Stream

    items = workload_texts(workload)
    engine = synth.batch(n)
    recs = [{"text": items[k % len(items)], "seed": seed + k, "first": None, "end": None, "samples": 0,
             "error": None} for k in range(n)]

    def sink(rec, chunk):
        if rec["first"] is None and len(chunk.samples):
            rec["first"] = clock.now()
        rec["samples"] += len(chunk.samples)

    def done(rec, error):
        rec["end"], rec["error"] = clock.now(), error

    clock.sync()
    t0 = clock.now()
    for rec in recs:
        engine.submit(Stream(lambda lane, r=rec: request_stream(synth, workload, r["text"], r["seed"], opts, lane),
                             lambda c, r=rec: sink(r, c), lambda e, r=rec: done(r, e)))
    engine.run()
    return _records(recs, t0, synth.sample_rate)


def _records(recs: list[dict], t0: float, rate: int) -> list[dict]:
    failed = [r["error"] for r in recs if r["error"] is not None]
    if failed:
        raise failed[0]
    out = []
    for r in recs:
        audio = r["samples"] / rate
        out.append({"text": r["text"], "seed": r["seed"], "audio_s": audio,
                    "ttfa_ms": None if r["first"] is None else (r["first"] - t0) * 1e3, "total_s": r["end"] - t0,
                    "rtf": (r["end"] - t0) / audio if audio else None})
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
                    wall += max(s["total_s"] for s in recs)
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
        """(each request is timed from its own send; the n threads send at once)"""
        items = workload_texts(workload)
        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(lambda k: http_sample(remote, workload, items[k % len(items)], seed + k, opts),
                                 range(n)))

    for workload in [w for w in opts.workloads if w != "bulk"]:
        t = time.perf_counter()
        for i in range(opts.warmup):
            together(workload, 10_000 + i * n)
        warmup_s = time.perf_counter() - t
        samples, wall = [], 0.0
        for r in range(opts.runs):
            t0 = time.perf_counter()
            samples += together(workload, r * n)
            wall += time.perf_counter() - t0
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
    if result.get("forced_lengths"):
        lines += ["", "Forced lengths (random weights): "
                  f"{loading.FORCED_REPLY_TOKENS} LLM tokens a reply, {loading.FORCED_FRAMES_PER_TOKEN} frames per TTS text token."]
    return "\n".join(lines) + "\n"
