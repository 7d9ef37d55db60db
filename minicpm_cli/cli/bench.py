"""`minicpm bench`: time to first audio, real-time factor and per-stage costs, per backend.

Timed pass: each request runs exactly as users run it (`Synthesizer.synthesize` / `reply`, chunks
consumed as a sink would); time to first audio (TTFA) is the time from the call to the first chunk
with samples, RTF the total time over the audio's duration. Stage pass: the same requests again with
the LLM forward, the TTS generation calls and the codec wrapped in device-synchronised timers, so
the timed pass is not slowed by synchronisation. Load, and warm-up (compilation included), are
reported apart from the steady state. With `random_weights` the full-size model is drawn on the
device and lengths are forced (24 LLM tokens per reply, 10 audio frames per TTS text token).

With `voice` (a recording), each workload is timed in a cloned voice too: the reference's encoding
(log-mel features, then the audio encoder with its projection and pooling, synchronised, uncached),
the audio encoder's loading (once, on the first voice; with random weights, its drawing), and TTFA
with the voice kept (its encoding and its turn's LLM context: a saved voice used again, a server's
steady state) and with a new file (both caches emptied before the request, the file's reading,
encoding and turn prefill inside the time), beside the default voice's TTFA taken the same way in
the same loop. A voice only changes how a request starts, so those requests are stopped at their
first audio.

With `server` (a URL) the same workloads go over HTTP to a running `minicpm serve`, as `say -o -` and
`reply` send them: TTFA is the time from sending the request to receiving the first audio bytes, RTF
the time to the response's end over the audio's duration. The server's model is measured whatever
it is; load and per-stage costs are the server's own and are not reported.

With `concurrency` N, `bench_many` runs the workloads N requests at a time.
"""

from __future__ import annotations

import datetime
import gc
import sys
import time
from dataclasses import dataclass

import torch

from ..engine import loading
from ..engine.llm import LLMSampling
from ..engine.loading import environment
from ..engine.sampling import Sampling

READ_TEXTS = (
    "Hi, how are you?",
    "The quick brown fox jumps over the lazy dog while the farmer watches from the old wooden porch, sipping coffee.",
    "Autumn arrived early that year. The maples along the river turned red and gold within a week, and "
    "every morning the fields were white with frost. The children walked to school through drifts of "
    "leaves, collecting the brightest ones for their teacher, who pressed them between the pages of a "
    "heavy dictionary and hung them in the windows of the classroom.",
)
REPLY_PROMPTS = ("I'm fine, thank you!", "What's your name?", "My name is John Doe",
                 "What's your favorite color?", "My favorite color is blue", "What's your favorite food?")
REPLY_WARMUP = "Hi, how are you?"
BULK_LINES = 256
REPLY_TEMPERATURE = 0.1  # the original benchmark's streaming_generate(temperature=0.1)


@dataclass(frozen=True)
class BenchOptions:
    backends: tuple[str, ...] = ("eager",)
    workloads: tuple[str, ...] = ("read", "reply")
    runs: int = 5
    warmup: int = 1
    random_weights: bool = False
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_tokens: int = 512  # reply length bound with a real checkpoint
    first_chunk: int = 25  # frames of the first streamed chunk
    gguf: str | None = None  # the GGUF file of the gguf backend
    server: str | None = None  # measure the minicpm server at this URL instead of loading backends
    concurrency: int | None = None  # streams started together (see `concurrent`)
    bulk_lines: int = BULK_LINES  # lines of the bulk workload
    voice: str | None = None  # a reference recording: time voice cloning too
    batch_variant: bool = False  # the faster kernels whose rounding depends on the batch
    arrival_rate: float | None = None  # with concurrency: requests a second (bench_many.arrivals), None: at once

    def __post_init__(self):
        if self.runs < 1 or self.warmup < 0:
            raise ValueError("--runs must be at least 1 and --warmup at least 0")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


class Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def now(self) -> float:
        return time.perf_counter()


class StageTimers:
    """Wraps the stages of a loaded Synthesizer with synchronised timers (stage pass only)."""

    def __init__(self, synth, clock: Clock):
        self.synth, self.clock = synth, clock
        self.prefill: list[tuple[int, float]] = []  # (tokens, ms)
        self.decode: list[float] = []  # ms per single-token LLM forward
        self.tts: list[tuple[int, float]] = []  # (steps, ms) per generation call
        self.codec: list[float] = []  # ms per decode call

    def _wrap(self, obj, name: str, record):
        """obj.name timed; -> what puts back what obj had: its own attribute where it had one (a
        backend's replacement, e.g. the CUDA-graph codec's `decode`), else the class's method."""
        original = getattr(obj, name)
        attrs = getattr(obj, "__dict__", {})
        had, own = name in attrs, attrs.get(name)

        def timed(*args, **kwargs):
            self.clock.sync()
            t = self.clock.now()
            out = original(*args, **kwargs)
            self.clock.sync()
            record((self.clock.now() - t) * 1e3, args, kwargs)
            return out

        setattr(obj, name, timed)

        def undo() -> None:
            if had:
                setattr(obj, name, own)
            elif name in getattr(obj, "__dict__", {}):
                delattr(obj, name)

        return undo

    def __enter__(self):
        s = self.synth

        def llm(ms, args, kw):
            ids = args[0]
            (self.decode.append(ms) if len(ids) == 1 else self.prefill.append((len(ids), ms)))

        def tts(ms, args, kw):
            steps = args[1] if len(args) > 1 else kw.get("n_steps", 25)
            self.tts.append((steps, ms))

        self._undo = [self._wrap(s.llm, "forward", llm), self._wrap(s.tts, "generate", tts),
                      self._wrap(s.codec, "decode", lambda ms, a, k: self.codec.append(ms))]
        return self

    def __exit__(self, *exc):
        for undo in self._undo:
            undo()


def workload_texts(workload: str):
    """The texts a workload reads (`read`) or replies to (`reply`)."""
    return READ_TEXTS if workload == "read" else REPLY_PROMPTS


def request_stream(synth, workload: str, item: str, seed: int | None, opts: BenchOptions, lane=None, voice=None):
    """One request of `workload` on `item`, as users make it -> its chunks (a batch's `lane` if given);
    seed None: greedy."""
    forced = loading.FORCED_FRAMES_PER_TOKEN if opts.random_weights else None
    sampling = Sampling(greedy=True) if seed is None else Sampling(seed=seed)
    if workload == "read":
        return synth.synthesize(item, sampling, frames_per_token=forced, first_chunk=opts.first_chunk, voice=voice,
                                lane=lane)
    tokens = loading.FORCED_REPLY_TOKENS if opts.random_weights else opts.max_tokens
    return synth.reply(item, sampling, llm=LLMSampling(temperature=REPLY_TEMPERATURE), max_tokens=tokens,
                       frames_per_token=forced, first_chunk=opts.first_chunk, voice=voice, lane=lane)


def bulk_lines(n: int = BULK_LINES) -> list[str]:
    """n lines of the read workload's sentences, in turn."""
    sentences = [s.strip() + "." for t in READ_TEXTS for s in t.split(".") if s.strip()]
    return [sentences[i % len(sentences)] for i in range(n)]


def sample(item: str, seed: int, ttfa: float | None, total: float, audio: float, frames: int | None) -> dict:
    """One request's record: times in seconds (TTFA in ms), its audio in seconds, RTF total / audio."""
    return {"text": item, "seed": seed, "ttfa_ms": None if ttfa is None else ttfa * 1e3, "total_s": total,
            "audio_s": audio, "rtf": total / audio if audio else None, "frames": frames}


def _one(synth, workload: str, item: str, seed: int, opts: BenchOptions, clock: Clock) -> dict:
    clock.sync()
    t0 = clock.now()
    ttfa, samples, frames = None, 0, 0
    for chunk in request_stream(synth, workload, item, seed, opts):
        if ttfa is None and len(chunk.samples):
            ttfa = clock.now() - t0
        samples += len(chunk.samples)
        frames += len(chunk.codes)
    return sample(item, seed, ttfa, clock.now() - t0, samples / synth.sample_rate, frames)


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def run(opts: BenchOptions) -> dict:
    if opts.server is not None:
        return run_server(opts)
    from ..engine.pipeline import Synthesizer, resolve_device

    device = resolve_device(opts.device)
    clock = Clock(device)
    result = {"environment": environment(device), "options": {**opts.__dict__},
              "forced_lengths": opts.random_weights, "results": []}
    if opts.random_weights:
        result["forced_lengths_note"] = (f"random weights: each reply is exactly {loading.FORCED_REPLY_TOKENS} LLM tokens and the "
                                         f"TTS makes {loading.FORCED_FRAMES_PER_TOKEN} frames per TTS text token (EOS ignored)")
    for backend in opts.backends:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        log(f"{backend}: loading")
        t = clock.now()
        synth = Synthesizer.load(opts.model, backend=backend, device=opts.device, dtype=opts.dtype,
                                 random_weights=opts.random_weights, gguf=opts.gguf if backend == "gguf" else None,
                                 batch_invariant=not opts.batch_variant)
        clock.sync()
        load_s = clock.now() - t
        result["environment"].setdefault("backend_versions", {})[backend] = getattr(synth.llm, "version", None)
        weight_bytes = getattr(synth.llm, "weight_bytes", None)
        for workload in opts.workloads:
            entry = {"backend": backend, "workload": workload, "load_s": load_s}
            t = clock.now()
            # Warm-up: the original benchmark's warm-up request, then every request of the workload
            # once, so that compilation and graph captures for every length happen here.
            warm = ([REPLY_WARMUP] if workload == "reply" else []) + list(workload_texts(workload))
            for i in range(opts.warmup):
                for item in warm:
                    _one(synth, workload, item, 10_000 + i, opts, clock)
            entry["warmup_s"] = clock.now() - t
            samples = []
            for r in range(opts.runs):
                for item in workload_texts(workload):
                    samples.append(_one(synth, workload, item, r, opts, clock))
                log(f"{backend} {workload}: run {r + 1}/{opts.runs}")
            with StageTimers(synth, clock) as st:
                for item in workload_texts(workload):
                    _one(synth, workload, item, 0, opts, clock)
            ttfa = [s["ttfa_ms"] for s in samples if s["ttfa_ms"] is not None]
            rtf = [s["rtf"] for s in samples if s["rtf"] is not None]
            decode_ms = percentile(st.decode, 0.5)
            entry.update({
                "samples": samples,
                "ttfa_ms": {"p50": percentile(ttfa, 0.5), "p90": percentile(ttfa, 0.9)},
                "rtf": {"p50": percentile(rtf, 0.5), "p90": percentile(rtf, 0.9)},
                "llm_prefill_ms": percentile([ms for _, ms in st.prefill], 0.5),
                "llm_prefill_samples": st.prefill,
                "llm_ms_per_token": decode_ms,
                "llm_decode_samples_ms": st.decode,
                "llm_weight_bytes_per_token": weight_bytes,
                "llm_gb_per_s": weight_bytes / decode_ms / 1e6 if weight_bytes and decode_ms else None,
                "tts_ms_per_step": percentile([ms / n for n, ms in st.tts if n], 0.5),
                "tts_call_samples": st.tts,
                "codec_ms_per_chunk": percentile(st.codec, 0.5),
                "codec_samples_ms": st.codec,
                # torch's peak plus what the LLM stage holds outside torch (llama.cpp)
                "peak_gpu_gib": (torch.cuda.max_memory_allocated(device) + getattr(synth.llm, "extra_gpu_bytes", 0))
                / 2**30 if device.type == "cuda" else None,
            })
            if opts.voice is not None:
                entry["voice"] = _voice_entry(synth, workload, opts, clock)
            result["results"].append(entry)
        del synth, st
        gc.collect()  # free this backend's model before the next one is measured
    return result


def _first_audio(synth, workload: str, item: str, seed: int, opts: BenchOptions, clock: Clock, voice) -> float | None:
    """TTFA (ms) of one request in `voice` (a Voice, or a file path read inside the time: a new voice);
    the request is stopped at its first audio (only its start differs from the default voice's)."""
    from ..voices.reference import Voice

    clock.sync()
    t0 = clock.now()
    if isinstance(voice, str):
        voice = Voice.load(voice)
    chunks = request_stream(synth, workload, item, seed, opts, voice=voice)
    try:
        for chunk in chunks:
            if len(chunk.samples):
                return (clock.now() - t0) * 1e3
    finally:
        chunks.close()
    return None


def _voice_entry(synth, workload: str, opts: BenchOptions, clock: Clock) -> dict:
    """The voice's costs for one workload (see the module's docstring). The default voice's TTFA,
    set beside the voice's, is taken the same way in the same loop (each request stopped at its
    first audio), one request of each kind in turn."""
    from ..voices.reference import Voice

    voice = Voice.load(opts.voice)
    mode, chunked = ("read", True) if workload == "read" else ("reply", False)
    t = clock.now()
    loaded = synth._voices is not None
    enc = synth.voices  # built at the first voice (counted once, with the first workload)
    clock.sync()
    load_s = None if loaded else clock.now() - t
    enc.encode(voice, chunked)  # (first-use costs out of the times)
    features, encode = [], []
    for _ in range(opts.runs):
        clock.sync()
        t = clock.now()
        enc.log_mel(voice)
        clock.sync()
        features.append((clock.now() - t) * 1e3)
        t = clock.now()
        enc.encode(voice, chunked)
        clock.sync()
        encode.append((clock.now() - t) * 1e3)
    for i in range(opts.warmup):
        for item in workload_texts(workload):
            _first_audio(synth, workload, item, 10_000 + i, opts, clock, voice)
    plain, cached, new = [], [], []
    for r in range(opts.runs):
        for item in workload_texts(workload):
            plain.append(_first_audio(synth, workload, item, r, opts, clock, None))
            synth.voice_context(synth.llm, voice, mode)  # (kept: encoded and its turn's context saved)
            cached.append(_first_audio(synth, workload, item, r, opts, clock, voice))
            synth.forget_voices()
            new.append(_first_audio(synth, workload, item, r, opts, clock, opts.voice))
        log(f"voice {workload}: run {r + 1}/{opts.runs}")

    def spread(xs):
        xs = [x for x in xs if x is not None]
        return {"p50": percentile(xs, 0.5), "p90": percentile(xs, 0.9)}

    return {"file": opts.voice, "seconds": voice.seconds, "prompt_tokens": len(enc.turn(voice, mode).ids),
            "encoder_load_s": load_s, "features_ms": spread(features), "encode_ms": spread(encode),
            "ttfa_default_ms": spread(plain),
            "ttfa_cached_ms": spread(cached), "ttfa_new_ms": spread(new),
            "ttfa_default_samples_ms": plain, "ttfa_cached_samples_ms": cached, "ttfa_new_samples_ms": new}


def http_sample(remote, workload: str, item: str, seed: int, opts: BenchOptions) -> dict:
    t0 = time.perf_counter()
    if workload == "read":
        chunks = remote.read(item, greedy=False, seed=seed, decode="stream", first_chunk=opts.first_chunk)
    else:
        chunks = remote.reply(item, greedy=False, seed=seed, temperature=REPLY_TEMPERATURE,
                              max_tokens=opts.max_tokens, first_chunk=opts.first_chunk)
    ttfa, samples = None, 0
    for chunk in chunks:  # (the request went out in read/reply)
        if ttfa is None and len(chunk.samples):
            ttfa = time.perf_counter() - t0
        samples += len(chunk.samples)
    return sample(item, seed, ttfa, time.perf_counter() - t0, samples / remote.sample_rate, None)


def run_server(opts: BenchOptions) -> dict:
    """The workloads over HTTP against the server at `opts.server` (see the module's docstring)."""
    from ..serving.client import Remote

    remote = Remote.find(opts.server, explicit=True)
    props = remote.props
    env = {**props.get("environment", {}), "server": remote.url, "server_version": props.get("version"),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    forced = props.get("forced_lengths")
    result = {"environment": env, "options": {**opts.__dict__}, "forced_lengths": bool(forced), "results": []}
    if forced:  # (a server started with --random-weights forces every request's lengths)
        result["forced_lengths_note"] = (f"random weights: each reply is exactly {forced['reply_tokens']} LLM tokens and "
                                         f"the TTS makes {forced['frames_per_token']} frames per TTS text token (EOS ignored)")
    backend = f"{props['backend']} (server)"
    for workload in opts.workloads:
        t = time.perf_counter()
        warm = ([REPLY_WARMUP] if workload == "reply" else []) + list(workload_texts(workload))
        for i in range(opts.warmup):
            for item in warm:
                http_sample(remote, workload, item, 10_000 + i, opts)
        warmup_s = time.perf_counter() - t
        samples = []
        for r in range(opts.runs):
            for item in workload_texts(workload):
                samples.append(http_sample(remote, workload, item, r, opts))
            log(f"{backend} {workload}: run {r + 1}/{opts.runs}")
        ttfa = [s["ttfa_ms"] for s in samples if s["ttfa_ms"] is not None]
        rtf = [s["rtf"] for s in samples if s["rtf"] is not None]
        result["results"].append({
            "backend": backend, "workload": workload, "load_s": None, "warmup_s": warmup_s, "samples": samples,
            "ttfa_ms": {"p50": percentile(ttfa, 0.5), "p90": percentile(ttfa, 0.9)},
            "rtf": {"p50": percentile(rtf, 0.5), "p90": percentile(rtf, 0.9)},
            **{key: None for key in ("llm_prefill_ms", "llm_ms_per_token", "llm_gb_per_s", "tts_ms_per_step",
                                     "codec_ms_per_chunk", "peak_gpu_gib")},
        })
    return result


def cell(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def device_line(result: dict) -> str:
    """The line over a table: where and on what it was measured (a server's environment may lack some)."""
    env = result["environment"]
    return (f"Device: {env['device']} (driver {env.get('driver') or '-'}), torch {env.get('torch', '-')}, "
            f"CUDA {env.get('cuda') or '-'}, commit {env.get('commit') or '-'}, {env['date']}"
            + (f", measured over HTTP at {env['server']}" if env.get("server") else "")
            + (", batch-variant kernels" if result["options"].get("batch_variant") else ""))


def table(result: dict) -> str:
    lines = [
        device_line(result),
        "",
        "| backend | workload | TTFA p50 / p90 (ms) | RTF p50 / p90 | LLM prefill (ms) | LLM ms/token | LLM GB/s "
        "| TTS ms/step | codec ms/chunk | peak GPU (GiB) | load (s) | warm-up (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in result["results"]:
        lines.append(
            f"| {e['backend']} | {e['workload']} | {cell(e['ttfa_ms']['p50'], '.1f')} / {cell(e['ttfa_ms']['p90'], '.1f')} "
            f"| {cell(e['rtf']['p50'], '.3f')} / {cell(e['rtf']['p90'], '.3f')} | {cell(e['llm_prefill_ms'], '.1f')} "
            f"| {cell(e['llm_ms_per_token'], '.2f')} | {cell(e['llm_gb_per_s'], '.0f')} | {cell(e['tts_ms_per_step'], '.2f')} "
            f"| {cell(e['codec_ms_per_chunk'], '.1f')} | {cell(e['peak_gpu_gib'], '.1f')} | {cell(e['load_s'], '.1f')} "
            f"| {e['warmup_s']:.1f} |")
    if result.get("forced_lengths_note"):
        lines += ["", f"Forced lengths: {result['forced_lengths_note']}."]
    voiced = [e for e in result["results"] if e.get("voice")]
    if voiced:
        v = voiced[0]["voice"]
        lines += ["", f"Voice {v['file']} ({v['seconds']:.2f} s): encode = log-mel features + audio encoder with "
                      "projection and pooling, uncached; TTFA with the voice's encoding cached, and with a new file "
                      "(read and encoded inside the time).", "",
                  "| backend | workload | encoder load (s) | features (ms) | encode p50 / p90 (ms) | voice prompt tokens "
                  "| TTFA default p50 (ms) | TTFA cached voice p50 / p90 (ms) | TTFA new voice p50 / p90 (ms) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for e in voiced:
            v = e["voice"]
            lines.append(
                f"| {e['backend']} | {e['workload']} | {cell(v['encoder_load_s'], '.2f')} | {cell(v['features_ms']['p50'], '.1f')} "
                f"| {cell(v['encode_ms']['p50'], '.1f')} / {cell(v['encode_ms']['p90'], '.1f')} | {v['prompt_tokens']} "
                f"| {cell(v['ttfa_default_ms']['p50'], '.1f')} "
                f"| {cell(v['ttfa_cached_ms']['p50'], '.1f')} / {cell(v['ttfa_cached_ms']['p90'], '.1f')} "
                f"| {cell(v['ttfa_new_ms']['p50'], '.1f')} / {cell(v['ttfa_new_ms']['p90'], '.1f')} |")
    return "\n".join(lines) + "\n"


