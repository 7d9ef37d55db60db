"""`minicpm bulk`: a file of items spoken into a directory, one audio file each, resumable
(scale.bulk), in this process or on Ray Data."""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ... import audio
from ...captions import FORMATS
from ...errors import MinicpmError, OptionError, UsageError
from ..options import (BackendOpt, BatchVariantOpt, DeviceOpt, DtypeOpt, GgufOpt, GpusOpt, GreedyOpt, ModelOpt, RayOpt, ReplicasOpt,
                       SpeedOpt, VerboseOpt, absolute_if_here, check_model_options, check_ray, check_sampling,
                       check_speed)
from ..speaker import load_here


def bulk(
    input: Annotated[str, typer.Argument(help="The items: a text file (an item each non-empty line), .jsonl, .csv, .tsv or .parquet (a text column; optional id, voice, seed).", show_default=False)],
    out: Annotated[str, typer.Option("--out", help="Directory for the audio files and manifest.jsonl (made if missing).", show_default=False)],
    ray_address: RayOpt = None,
    replicas: ReplicasOpt = None,
    gpus_per_replica: GpusOpt = None,
    batch: Annotated[Optional[int], typer.Option("--batch", help="Items per batch given to a model, generated at once [default: 8, generated as many at once as the GPU's free memory holds, at most 8].", show_default=False)] = None,
    fmt: Annotated[str, typer.Option("--format", help="Audio files: wav or flac (16-bit).")] = "wav",
    captions: Annotated[Optional[str], typer.Option("--captions", help="Also write DIR/<id>.srt or .vtt beside each audio file (named in the manifest): srt or vtt.", show_default=False)] = None,
    model: ModelOpt = None,
    backend: BackendOpt = "auto",
    gguf: GgufOpt = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Give each item the seed derived from this one and its id (docs/scale-out.md): its audio is then `say --seed <derived>`'s, wherever it runs [default: a seed drawn for the run].", show_default=False)] = None,
    greedy: GreedyOpt = False,
    speed: SpeedOpt = 1.0,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    verbose: VerboseOpt = False,
    batch_variant: BatchVariantOpt = False,
    random_weights: Annotated[bool, typer.Option("--random-weights", help="For speed work: the full-size model with random weights drawn on the device, no checkpoint; lengths forced as `bench --random-weights` forces them. Its audio is noise.")] = False,
) -> None:
    """Speak many texts, one audio file each: DIR/<id>.wav and DIR/manifest.jsonl.

    Items without an id are named line-0001, line-0002, ... as `say --lines --dir` names them. A run
    skips the items the manifest lists as complete, so running it again after a crash finishes the
    job. Without --ray the model runs in this process; with --ray, Ray Data runs batches on a pool of
    model replicas across the cluster (the files are written here).
    """
    from ...scale import bulk as b

    if fmt not in b.FORMATS:
        raise OptionError(f"--format must be wav or flac, not '{fmt}'")
    if captions is not None and captions not in FORMATS:
        raise OptionError(f"--captions must be {' or '.join(FORMATS)}, not '{captions}'")
    if batch is not None and batch < 1:
        raise OptionError("--batch must be at least 1")
    rows = batch  # (a --batch given is generated at once, or a one-line error says what fits)
    batch = batch or b.DEFAULT_BATCH
    check_sampling(greedy, seed)
    check_speed(speed)
    check_model_options(backend, device, dtype, gguf)
    address, bounds = check_ray(ray_address, replicas, gpus_per_replica)
    if address is not None:
        from ...scale.cluster import require_ray

        require_ray("data")
    path = Path(input).expanduser()
    if input == "-":
        raise UsageError("bulk reads a file (its items are read again to resume): save standard input to one first")
    if path.is_dir():
        raise UsageError(f"{input} is a directory: bulk reads a file of items (.txt, .jsonl, .csv, .tsv, .parquet)")
    if not path.exists():
        raise UsageError(f"no such file: {input}")
    if not path.is_file():  # (/dev/stdin, a named pipe: read once, and a rerun would find nothing)
        raise UsageError(f"{input} is not a regular file: bulk reads its items again to resume, so save them "
                         f"to a file first")
    items = b.plan(b.read_rows(path), fmt=fmt, greedy=greedy, seed=seed, base=path.resolve().parent, speed=speed)
    if not items:
        raise UsageError(f"no items in {input}")
    items = b.check_voices(items)
    if not random_weights and any(i.voice is not None for i in items) and model is not None \
            and Path(model).expanduser().is_dir():  # (a hub model: checked where it loads)
        from ...engine.cloning import require_encoder

        require_encoder(Path(model).expanduser())
    made = not Path(out).expanduser().exists()
    directory = audio.make_directory(out)
    if address is not None:
        model, gguf = absolute_if_here(model), absolute_if_here(gguf)
    load = functools.partial(load_here, model, backend, device, dtype, gguf, verbose, rows,  # (rows: a batch at once)
                             batch_variant, random_weights, most_rows=batch)
    forced = None
    if random_weights:
        from ...engine.loading import FORCED_FRAMES_PER_TOKEN as forced
    if address is None:
        def results(pending):
            return b.in_process(pending, load, batch, forced)
    else:
        say = (lambda line: print(line, file=sys.stderr, flush=True)) if verbose else (lambda line: None)
        opts = b.RayOptions(address, bounds, gpus_per_replica)

        def results(pending):
            return b.on_ray(pending, load, batch, opts, device, say, forced)
    try:
        summary = b.run(items, directory, results, progress=sys.stderr.isatty(), captions=captions)
    except BaseException:
        if made:  # (a run that failed before writing anything leaves no empty directory behind)
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
    finally:
        if address is not None:
            from ...scale.cluster import disconnect

            disconnect()
    for item_id, error in summary.failed:
        print(f"minicpm: {item_id}: {error}", file=sys.stderr)
    if summary.skipped == summary.items:
        print(f"minicpm: {summary.items} items in {directory}: all {summary.items} already there", file=sys.stderr)
    else:
        print(f"minicpm: {summary.items} items in {directory}: {summary.spoken} spoken ({summary.seconds:.1f} s of "
              f"audio in {summary.elapsed:.1f} s), {summary.skipped} already there"
              + (f", {len(summary.failed)} failed" if summary.failed else ""), file=sys.stderr)
    if summary.failed:
        raise MinicpmError(f"{len(summary.failed)} of {summary.items} items failed (named above); "
                           f"run the same command again to retry them")
