"""`minicpm bench`: the options checked, then the benchmark (cli.bench) run and its table printed."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ... import backends as registry
from ...errors import OptionError, UsageError
from ..options import BatchVariantOpt, DeviceOpt, DtypeOpt, FirstChunkOpt, GgufOpt, ModelOpt, check_model_options, chunk_frames


def bench(
    backend: Annotated[Optional[str], typer.Option("--backend", "-b", help="Comma-separated backends to compare [default: every backend whose dependencies are installed].", show_default=False)] = None,
    workload: Annotated[str, typer.Option("--workload", help="read (say of 3 texts), reply (6 prompts), bulk (256 lines, with --concurrency) or all.")] = "all",
    runs: Annotated[int, typer.Option("--runs", help="Timed runs over each workload.")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed warm-up requests per workload (compilation happens here).")] = 1,
    random_weights: Annotated[bool, typer.Option("--random-weights", help="Full-size model with random weights drawn on the device (no checkpoint); lengths forced.")] = False,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Write every sample as JSON to FILE.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Most LLM tokens per reply (with a real checkpoint).")] = 512,
    first_chunk: FirstChunkOpt = None,
    model: ModelOpt = None,
    gguf: GgufOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    server: Annotated[Optional[str], typer.Option("--server", help="Measure the minicpm server at URL over HTTP (its own model) instead of loading backends here.", show_default=False)] = None,
    startup: Annotated[bool, typer.Option("--startup", help="Time one-shot `say` commands in fresh processes on the checkpoint directory --model DIR, phase by phase, with empty and with filled compilation caches.")] = False,
    concurrency: Annotated[Optional[int], typer.Option("--concurrency", "-c", help="Start N requests together (one batch of streams, or N at once to --server): per-request TTFA, per-stream RTF and audio seconds per wall second; the bulk workload reads 256 lines with N in flight.", show_default=False)] = None,
    voice: Annotated[Optional[str], typer.Option("--voice", help="Also time voice cloning with this recording: its encoding, and TTFA with the voice cached and as a new file (needs a checkpoint with the audio encoder, or --random-weights).", show_default=False)] = None,
    arrival_rate: Annotated[Optional[float], typer.Option("--arrival-rate", help="With --concurrency: the N requests arrive at R a second (a seeded Poisson process) instead of all at once, each timed from its arrival (read and reply; bulk keeps N in flight).", show_default=False)] = None,
    batch_variant: BatchVariantOpt = False,
) -> None:
    """Benchmark backends: time to first audio, real-time factor, per-stage costs (table on stdout)."""
    if concurrency is not None and (concurrency < 1 or startup or voice is not None):
        raise OptionError("--concurrency takes a number of streams of at least 1, and neither --startup nor --voice")
    if arrival_rate is not None and (concurrency is None or not arrival_rate > 0):
        raise OptionError("--arrival-rate takes requests a second above 0, with --concurrency N")
    if max_tokens < 1:
        raise OptionError("--max-tokens must be at least 1")
    json_out = _json_target(json_out)
    if voice is not None:
        if startup or server is not None:
            raise OptionError("--voice times voice cloning on a model loaded here: not with --startup or --server")
        from ...voices.reference import Voice
        from ...voices.store import locate

        path = locate(voice)  # (as `say --voice` takes it: a recording, or a saved voice's name)
        if path is None:
            raise OptionError(f"--voice {voice} is the model's own voice: name a recording or a saved voice to time")
        voice = str(path)
        Voice.load(voice)  # (a file that cannot be a voice is refused before anything loads)
    if startup:
        if model is None or random_weights or server is not None:
            raise OptionError("--startup needs --model DIR (a checkpoint directory), without --random-weights or --server")
        given = [flag for flag, value in (("--workload", None if workload == "all" else workload),
                                          ("--runs", None if runs == 5 else runs),
                                          ("--warmup", None if warmup == 1 else warmup),
                                          ("--max-tokens", None if max_tokens == 512 else max_tokens),
                                          ("--first-chunk", first_chunk), ("--gguf", gguf),
                                          ("--dtype", None if dtype == "auto" else dtype),
                                          ("--batch-variant", batch_variant or None)) if value is not None]
        if given:  # (it times fixed `say` commands: one of each kind, caches emptied and filled)
            raise OptionError(f"--startup times one-shot `say` commands as a user runs them: {', '.join(given)} "
                              f"cannot apply")
        names = tuple(b.strip() for b in backend.split(",") if b.strip()) if backend else \
            tuple(n for n, b in registry.REGISTRY.items() if b.available() and n != "gguf")
        for name in names:
            registry.get(name).check()
        from .. import startup as s

        runs_ = s.run(model, names, device)
        if json_out:
            _write(json_out, json.dumps([vars(r) for r in runs_], indent=1) + "\n")
        sys.stdout.write(s.table(runs_, model))
        return
    if server is not None:  # the server's model, whatever it is: nothing here chooses or loads one
        given = [flag for flag, value in (("--backend", backend), ("--random-weights", random_weights or None),
                                          ("--model", model), ("--gguf", gguf),
                                          ("--device", None if device == "auto" else device),
                                          ("--dtype", None if dtype == "auto" else dtype)) if value is not None]
        if given:
            raise OptionError(f"--server measures the server's own model: {', '.join(given)} cannot apply")
        names: tuple[str, ...] = ()
    elif backend is None:  # every installed backend (gguf only when given a GGUF file to run)
        names = tuple(name for name, b in registry.REGISTRY.items()
                      if b.available() and (name != "gguf" or gguf is not None))
    else:
        names = tuple(b.strip() for b in backend.split(",") if b.strip())
    if not names and server is None:
        raise OptionError("--backend needs at least one name")
    for name in names:
        if name != registry.AUTO:  # (auto: chosen as it loads, by the device, checkpoint and free memory)
            registry.get(name).check()
    check_model_options(",".join(names) or registry.AUTO, device, dtype, gguf)
    workloads = {"read": ("read",), "reply": ("reply",), "bulk": ("bulk",),
                 "all": ("read", "reply") + (("bulk",) if concurrency and server is None else ())}.get(workload)
    if workloads is None:
        raise OptionError(f"unknown workload '{workload}' (read, reply, bulk or all)")
    if workloads == ("bulk",) and concurrency is None:
        raise OptionError("--workload bulk measures batches: give --concurrency N")
    if "bulk" in workloads and server is not None:
        raise OptionError("--workload bulk runs here (say --lines --dir --batch); against --server use read or reply")
    if runs < 1 or warmup < 0:
        raise OptionError("--runs must be at least 1 and --warmup at least 0")
    from .. import bench as b
    from .. import bench_many

    opts = b.BenchOptions(backends=names, workloads=workloads, runs=runs, warmup=warmup,
                          random_weights=random_weights, model=model, device=device, dtype=dtype,
                          max_tokens=max_tokens, first_chunk=chunk_frames(first_chunk), gguf=gguf, server=server,
                          concurrency=concurrency, voice=voice, batch_variant=batch_variant,
                          arrival_rate=arrival_rate)
    result = b.run(opts) if concurrency is None else bench_many.concurrent(opts)
    if json_out:
        _write(json_out, json.dumps(result, indent=1) + "\n")
    sys.stdout.write(b.table(result) if concurrency is None else bench_many.concurrency_table(result))


def _json_target(json_out: Optional[str]) -> Optional[str]:
    """--json FILE checked before anything runs (a benchmark's minutes are not lost to its name)."""
    if json_out is None:
        return None
    if json_out == "-":
        raise OptionError("--json writes a file (the table is on stdout): give a file name")
    from ...files import check_target

    check_target(json_out, "--json")
    return json_out


def _write(path: str, text: str) -> None:
    """The JSON written whole (files.write_whole): an error is one line, not the run lost to a traceback."""
    from ...files import write_whole

    try:
        write_whole(path, text.encode("utf-8"))
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None
