"""`minicpm bulk`: many texts, one audio file each, in this process or on a Ray cluster.

In: INPUT, read here (`read_items`): a text file (an item each non-empty line), JSONL or Parquet (a
`text` column; optional `id`, `voice`: what `say --voice` takes (a recording, relative to INPUT's
folder, `default`, or a saved voice's name), `seed`).
Out, in DIR: a file per item, `<id>.wav` (or `.flac`), written to a temporary name and renamed when
complete by the writer of `say -o FILE` (`audio.FileSink`), and `manifest.jsonl`: one JSON line per
completed item (id, text, file, seconds, seed, voice, voice_digest, speed, bytes), appended and
flushed to disk once its file is in place. Items without an id are named as `say --lines --dir` names its lines, by their
position among the items: `line-0001`, `line-0002`, ...

Where an item runs changes nothing. Its audio depends only on the model, its text, its voice, its
seed and the run's `--speed`: `--greedy` draws nothing; `--seed S` gives each item the seed `derive_seed(S, id)` (an item's own
`seed` wins); with neither, S is drawn once per run. The manifest records the seed each item got, and
its file is the one `minicpm say TEXT --seed SEED [--speed X] -o FILE` writes, whichever process, batch or run
made it (each utterance has its own generator; the pipeline resets the model per utterance).

Resume: a run skips the items that the manifest lists with their file in place (same text, voice
and its samples, seed, speed, file name and size) and speaks the rest. A crash loses at most the
items in flight: no file is ever half-written, and no line names a file that is not complete.

The synthesis: `Speaker` loads the model once (in `__init__`) and maps a batch of items to their
audio; the one function that speaks a batch is `synthesize_batch`. The batches are the same wherever
they run (`batches`): the items longest text first, cut into batches of `--batch`, so that the items a
model generates together end at about the same time (a batch lasts as long as its longest item) and
the job ends on its shortest batches. Without Ray the batches go through one `Speaker` in this
process. With Ray, Ray Data streams them through a pool of `Speaker` actors (`map_batches`: one model
per actor, a dead actor restarted and its batches retried) and the audio comes back here, where every
file and the manifest are written: the actors need no access to DIR and only one process ever writes
the manifest.

Over the house's ~450 lines as one job's life: items read and planned, the manifest and resuming,
the model as a function of batches, and the run that ties them (in this process or on Ray).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import random
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import protocol, trace
from ..errors import MinicpmError, OptionError, UsageError, VoiceError
from ..files import write_whole
from ..voices.store import VoiceStore, locate

MANIFEST = "manifest.jsonl"
FORMATS = ("wav", "flac")
DEFAULT_BATCH = 8  # bulk --batch: items a batch (generated at once as far as the GPU's memory holds)
MAX_BLOCKS = 2000  # blocks the items are cut into on Ray (each a whole number of batches)
TASKS_PER_ACTOR = 2  # batches Ray Data hands an actor at once: the one it runs and the next
# what the actors take from the driver's environment, where it is set: the compiled-kernel caches
# (Triton's, TorchInductor's, NVRTC's), so that every replica of a job reads and fills the same ones
CACHE_VARIABLES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "MINICPM_CACHE_DIR")
SAMPLE_RATE = 24000  # (pipeline.SAMPLE_RATE; this module imports no torch)
_ID = re.compile(r"\w[\w.\-]*")  # an id names a file: no separators, no leading dot
# its length in bytes: a file name holds 255 (NAME_MAX), and `.<id>.flac.<8 random>.partial`, the
# name a file is written under, 23 more than the id
MAX_ID_BYTES = 200


def derive_seed(seed: int, item_id: str) -> int:
    """The seed of item `item_id` in a run with `--seed seed`: the first 8 bytes of SHA-256 of the
    UTF-8 text "SEED:ID", big-endian, shifted right by one bit (0 <= result < 2**63)."""
    digest = hashlib.sha256(f"{seed}:{item_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@dataclass(frozen=True)
class Item:
    """One text to speak and where its audio goes."""

    id: str
    text: str  # stripped, as spoken
    file: str  # the file name in DIR
    seed: int | None  # None: greedy
    voice: str | None = None  # absolute path of a reference recording
    seed_given: bool = True  # False: drawn for this run (a finished item's recorded seed is as good)
    speed: float = 1.0  # the tempo (--speed)
    voice_digest: str | None = None  # the voice's samples' hash (`Voice.digest`): a file replaced is another voice


# -- reading INPUT ---------------------------------------------------------------------------------


def read_rows(path: Path) -> list[dict]:
    """INPUT's items as dicts (text, and id, voice, seed where given), in order. A text file gives
    one per non-empty line, JSONL one per non-empty line (an object), Parquet, CSV and TSV (a header
    row naming the columns) one per row."""
    suffix = path.suffix.lower()
    try:
        if suffix in (".jsonl", ".ndjson"):
            rows = []
            with open(path, encoding="utf-8-sig") as f:  # (-sig: an editor's byte-order mark, as in every format)
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise UsageError(f"{path}, line {n}: not JSON ({e.msg})") from None
                    if not isinstance(row, dict):
                        raise UsageError(f"{path}, line {n}: not a JSON object")
                    rows.append(row)
            return rows
        if suffix in (".parquet", ".pq"):
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise UsageError("reading Parquet needs pyarrow: pip install pyarrow (the ray extra has it: "
                                 "pip install 'minicpm-cli[ray]')") from None
            try:
                rows = pq.read_table(path).to_pylist()
            except Exception as e:  # (pyarrow's own error types)
                raise UsageError(f"cannot read {path} as Parquet: {e}") from None
            # a cell that pandas left empty is null or NaN (a column of ids or seeds with a gap is
            # then of floats): the field is not given
            return [{k: v for k, v in row.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}
                    for row in rows]
        if suffix in (".csv", ".tsv"):
            return _table_rows(path, "\t" if suffix == ".tsv" else ",")
        with open(path, encoding="utf-8-sig") as f:
            return [{"text": line} for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {path}: {e}") from None


def _table_rows(path: Path, delimiter: str) -> list[dict]:
    """A CSV or TSV file's rows (RFC 4180 quoting: a text may hold the delimiter, quotes and line
    breaks), by the header's column names; blank cells left out, a seed cell read as an integer."""
    import csv

    with open(path, encoding="utf-8-sig", newline="") as f:  # (-sig: a spreadsheet's byte-order mark)
        reader = csv.DictReader(f, delimiter=delimiter, strict=True)
        columns = reader.fieldnames or []
        if "text" not in columns:
            raise UsageError(f"{path}: the first row names the columns, and none is 'text' (it has: "
                             f"{', '.join(repr(c) for c in columns) or 'nothing'})")
        rows, start = [], 2
        try:
            for row in reader:
                start = reader.line_num + 1  # (where the next row begins: the one an error is in)
                row = {k: v for k, v in row.items() if k is not None and v is not None and v.strip() != ""}
                if not row:
                    continue  # (a blank line)
                if "seed" in row:
                    try:
                        row["seed"] = int(row["seed"].strip())
                    except ValueError:
                        raise UsageError(f"{path}, line {reader.line_num}: seed {row['seed']!r} is not an "
                                         f"integer") from None
                rows.append(row)
        except csv.Error as e:
            hint = " (a quote not closed?)" if "unexpected end of data" in str(e) else ""
            raise UsageError(f"{path}, the row from line {start}: {e}{hint}") from None
    return rows


def plan(rows: Sequence[dict], *, fmt: str, greedy: bool, seed: int | None, base: Path,
         store: VoiceStore | None = None, speed: float = 1.0) -> list[Item]:
    """The items of `rows`, checked: text present, ids unique and usable as file names, seeds in
    range and not with --greedy; voices as `say --voice` takes them (`voices.store.locate`: relative
    paths from `base`, INPUT's folder; saved names from `store`, by default the user's)."""
    if seed is None and not greedy:
        run_seed, drawn = random.SystemRandom().randrange(2**63), True
    else:
        run_seed, drawn = seed, False
    items, seen = [], {}
    for n, row in enumerate(rows, 1):
        where = f"item {n}"
        text = row.get("text")
        if not isinstance(text, str) or not text.strip():
            raise UsageError(f"{where} has no text")
        problem = protocol.not_unicode(text, f"{where}'s text")  # (a JSON "\\ud800": no tokenizer reads it)
        if problem:
            raise UsageError(problem)
        raw_id = row.get("id")
        if raw_id is None or raw_id == "":
            item_id = f"line-{n:04d}"
        elif (isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool) and _ID.fullmatch(str(raw_id))
              and len(str(raw_id).encode()) <= MAX_ID_BYTES):
            item_id = str(raw_id)
        else:
            raise UsageError(f"{where}: the id {raw_id!r} cannot name a file (letters, digits, '_', '.', '-'; "
                             f"not starting with '.' or '-'; at most {MAX_ID_BYTES} bytes in UTF-8)")
        if item_id in seen:
            raise UsageError(f"{where}: the id '{item_id}' is also item {seen[item_id]}'s")
        seen[item_id] = n
        own = row.get("seed")
        if isinstance(own, float) and own.is_integer():  # (42.0: a JSON number or a Parquet float column)
            own = int(own)
        if own is not None:
            if isinstance(own, bool) or not isinstance(own, int):
                raise UsageError(f"{where}: seed {own!r} is not an integer")
            if not protocol.SEED_RANGE[0] <= own <= protocol.SEED_RANGE[1]:
                raise UsageError(f"{where}: seed must be between {protocol.SEED_RANGE[0]} and {protocol.SEED_RANGE[1]}")
            if greedy:
                raise OptionError(f"{where} has a seed, but --greedy draws nothing (drop one or the other)")
        voice = row.get("voice")
        if voice is not None and voice != "":
            if not isinstance(voice, str):
                raise UsageError(f"{where}: voice {voice!r} is not a file name or a saved voice's name")
            try:  # (what `say --voice` takes: the file to read travels with the item, as its path)
                found = locate(voice, store, base=base)
            except VoiceError as e:
                raise UsageError(f"{where}: {e}") from None
            voice = None if found is None else str(found)
        else:
            voice = None
        if greedy:
            item_seed, given = None, True
        elif own is not None:
            item_seed, given = own, True
        else:
            item_seed, given = derive_seed(run_seed, item_id), not drawn
        items.append(Item(item_id, text.strip(), f"{item_id}.{fmt}", item_seed, voice, given, speed))
    return items


def check_voices(items: Sequence[Item]) -> list[Item]:
    """`items` with their voices' digests: every distinct reference read once here, so that a bad one
    is an error before anything runs, and so that resuming knows a voice whose file was replaced (a
    saved voice added again with --force) from the one an item was spoken in."""
    import dataclasses

    from ..voices.reference import Voice

    digests = {path: Voice.load(path).digest for path in sorted({i.voice for i in items if i.voice is not None})}
    return [dataclasses.replace(i, voice_digest=digests[i.voice]) if i.voice is not None else i for i in items]


# -- the manifest ----------------------------------------------------------------------------------


class Manifest:
    """DIR/manifest.jsonl: a line per completed item, the last line of an id the one that counts.
    A line cut short by a crash (the last, without its newline) and lines that are not entries are
    dropped when the file is next opened (rewritten whole under a temporary name, then renamed)."""

    def __init__(self, directory: Path):
        self.path = directory / MANIFEST
        self.entries: dict[str, dict] = {}
        self._dirty = False
        self._read()

    def _read(self) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        lines = data.split(b"\n")
        if lines[-1]:  # (no trailing newline: a line cut short)
            self._dirty = True
        for line in lines[:-1]:
            try:
                entry = json.loads(line)
                if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
                    raise ValueError
            except ValueError:
                self._dirty = True
                continue
            if entry["id"] in self.entries:
                self._dirty = True
                del self.entries[entry["id"]]  # (the later line counts, in its place)
            self.entries[entry["id"]] = entry

    def complete(self, item: Item, directory: Path) -> bool:
        """Whether `item` is done: its entry says what it is now, and its file is there, whole."""
        e = self.entries.get(item.id)
        if e is None or (e.get("text"), e.get("voice"), e.get("file")) != (item.text, item.voice, item.file):
            return False
        if e.get("speed", 1.0) != item.speed or e.get("voice_digest") != item.voice_digest:
            return False
        if item.seed_given and e.get("seed") != item.seed:
            return False
        if not item.seed_given and e.get("seed") is None:  # (a greedy file, now a sampled run)
            return False
        try:
            return (directory / item.file).stat().st_size == e.get("bytes")
        except OSError:
            return False

    def tidy(self) -> None:
        """Rewrite the file as its entries, once, if a crash or a redone item left anything else."""
        if not self._dirty:
            return
        write_whole(self.path, "".join(_line(e) for e in self.entries.values()).encode("utf-8"), sync=True)
        self._dirty = False

    def append(self, entry: dict) -> None:
        if entry["id"] in self.entries:
            self._dirty = True
            del self.entries[entry["id"]]
        self.entries[entry["id"]] = entry
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(_line(entry))
            f.flush()
            os.fsync(f.fileno())


def _line(entry: dict) -> str:
    return json.dumps(entry, ensure_ascii=False) + "\n"


@contextlib.contextmanager
def _lock(directory: Path):
    """One run at a time in a directory (two would speak the same items and race on the manifest)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UsageError(f"another minicpm bulk is writing to {directory}") from None
        yield
    finally:
        os.close(fd)


# -- speaking a batch ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """What one utterance needs: its text, how to sample it, the voice (a voice.Voice) or None."""

    text: str
    sampling: Any  # a sampling.Sampling
    voice: Any = None
    speed: float = 1.0


def synthesize_batch(synth, requests: Sequence[Request], frames_per_token: int | None = None) -> list:
    """A batch of requests -> their utterances (`pipeline.Utterance`), in order: the one place where
    `bulk` speaks, generated together (`Synthesizer.say_batch`, as many at once as the model was
    loaded with rows). Each utterance is the one `synth.say` gives for its request alone (requests of
    another speed, which a run does not mix, in a batch of their own). `frames_per_token`: lengths
    forced (random weights, for speed work)."""
    out: list = [None] * len(requests)
    for speed in dict.fromkeys(r.speed for r in requests):
        mine = [i for i, r in enumerate(requests) if r.speed == speed]
        said = synth.say_batch([(requests[i].text, requests[i].sampling, requests[i].voice) for i in mine], speed=speed,
                               frames_per_token=frames_per_token)
        for i, u in zip(mine, said):
            out[i] = u
    return out


class Speaker:
    """One model, loaded once; a batch of items in, their audio out. The batch is a dict of columns
    (numpy arrays), Ray Data's "numpy" batch format: `id`, `text`, `seed` (the seed in decimal, ""
    for greedy), `voice` (a path, "" for none), `speed` (decimal). Out: `id`, `audio` (float32 samples,
    little-endian bytes), `seconds`, `marks` (the utterance's caption marks, `Utterance.marks`, as JSON),
    `error` ("" or the item's one-line error: the batch goes on without it)."""

    loader: Callable[[], Any] | None = None  # (set by `speaker_class`)
    frames_per_token: int | None = None  # lengths forced (random weights)

    def __init__(self, load: Callable[[], Any] | None = None, frames_per_token: int | None = None,
                 voices: bool = False):
        trace.mark("speaker_start")  # (on Ray: the actor's process is up, the model not yet loaded)
        self.synth = (load or self.loader)()
        self.voices: dict[str, Any] = {}
        if frames_per_token is not None:
            self.frames_per_token = frames_per_token
        if voices:  # items have voices: the audio encoder now, so that a checkpoint without one is one
            self.synth.voices  # error before anything is spoken, not each voice item's (a UsageError)
        rows = getattr(self.synth, "rows", 1)
        if rows > 1 and hasattr(self.synth, "warm_batches"):
            # the graphs a batch of `rows` captures (and the kernels they compile): now, as part of the
            # start, rather than in the first batch (say_batch would; once done, it does nothing)
            self.synth.warm_batches(rows)
        trace.mark("speaker_ready", gpus=os.environ.get("CUDA_VISIBLE_DEVICES"))

    def _voice(self, path: str):
        if not path:
            return None
        if path not in self.voices:
            from ..voices.reference import Voice

            self.voices[path] = Voice.load(path)
        return self.voices[path]

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from ..engine.sampling import Sampling

        began = time.time()
        requests, errors = [], []
        for text, seed, voice, speed in zip(batch["text"], batch["seed"], batch["voice"], batch["speed"]):
            seed = str(seed)
            try:
                requests.append(Request(str(text), Sampling(greedy=not seed, seed=int(seed) if seed else None),
                                        self._voice(str(voice)), float(speed)))
                errors.append("")
            except MinicpmError as e:  # (a voice that this machine cannot read)
                requests.append(None)
                errors.append(_one_line(e))
        utterances = self._speak(requests, errors)
        audio = np.empty(len(requests), dtype=object)
        audio[:] = [b"" if u is None else np.asarray(u.audio, "<f4").tobytes() for u in utterances]
        seconds = [0.0 if u is None else len(u.audio) / u.sample_rate for u in utterances]
        trace.mark("bulk_batch", began=began, items=len(requests), audio_s=sum(seconds))
        return {"id": np.asarray(batch["id"], dtype=object), "audio": audio,
                "seconds": np.array(seconds),
                "marks": np.array(["[]" if u is None else json.dumps(u.marks) for u in utterances], dtype=object),
                "error": np.array(errors, dtype=object)}

    def _speak(self, requests: list, errors: list[str]) -> list:
        """The batch's utterances; when it fails with an item's error (text the tokenizer cannot read),
        each item alone, so that only the items at fault fail."""
        good = [i for i, r in enumerate(requests) if r is not None]
        out: list = [None] * len(requests)
        try:
            for i, u in zip(good, synthesize_batch(self.synth, [requests[i] for i in good], self.frames_per_token)):
                out[i] = u
            return out
        except MinicpmError:
            pass
        for i in good:
            try:
                out[i] = synthesize_batch(self.synth, [requests[i]], self.frames_per_token)[0]
            except MinicpmError as e:
                errors[i] = _one_line(e)
        return out


def speaker_class(load: Callable[[], Any], frames_per_token: int | None = None) -> type[Speaker]:
    """A Speaker whose loader is part of the class. Ray keeps a class with the actor's definition,
    while constructor arguments of a restartable actor stay in the object store, where a restart
    cannot find them once they are lost (ray-project/ray#53727)."""
    return type("Speaker", (Speaker,), {"loader": staticmethod(load), "frames_per_token": frames_per_token})


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _columns(items: Sequence[Item]) -> dict[str, np.ndarray]:
    def col(values):
        a = np.empty(len(values), dtype=object)
        a[:] = values
        return a

    return {"id": col([i.id for i in items]), "text": col([i.text for i in items]),
            "seed": col(["" if i.seed is None else str(i.seed) for i in items]),
            "voice": col([i.voice or "" for i in items]), "speed": col([repr(i.speed) for i in items])}


# -- where the batches run -------------------------------------------------------------------------


def batches(items: Sequence[Item], batch: int) -> list[list[Item]]:
    """The batches a job's items are spoken in, in the order they start: the items longest text first
    (ties in input order), `batch` at a time. A model generates a batch's items together and the batch
    lasts as long as its longest item; items of about the same length end together, so the rows stay
    busy to the batch's end, and the job ends on its shortest batches, so no replica is left finishing
    a long one while the others idle (the text's length is the cost known before speaking: the audio
    grows with it). The same batches in this process and on Ray, so the same batches wherever the
    items run. Files are named by id, so the order changes no file and no manifest entry (only the
    order of the lines)."""
    ordered = sorted(items, key=lambda i: -len(i.text))
    return [ordered[k : k + batch] for k in range(0, len(ordered), batch)]


@dataclass(frozen=True)
class RayOptions:
    address: str  # "auto" or a cluster address (cluster.connect)
    replicas: tuple[int, int] | None = None  # actors (min, max); None: as many as the GPUs hold (1 without)
    gpus: float | None = None  # per actor; None: 1 where the cluster has GPUs and the device is not cpu


def in_process(items: Sequence[Item], load: Callable[[], Any], batch: int,
               frames_per_token: int | None = None) -> Iterator[dict]:
    """The batches through one Speaker in this process, one after the other."""
    speaker = Speaker(load, frames_per_token, voices=any(i.voice is not None for i in items))
    for group in batches(items, batch):
        yield speaker(_columns(group))


def cache_environment() -> dict[str, str]:
    """The variables of CACHE_VARIABLES set here, for the actors' runtime environment. Unset, each
    process uses its user's default directories, which the replicas on one node share already."""
    return {k: os.environ[k] for k in CACHE_VARIABLES if os.environ.get(k)}


def on_ray(items: Sequence[Item], load: Callable[[], Any], batch: int, opts: RayOptions, device: str,
           say: Callable[[str], None], frames_per_token: int | None = None) -> Iterator[dict]:
    """The batches through a pool of Speaker actors on a Ray cluster (Ray Data), results as they come."""
    import pyarrow as pa

    from . import cluster

    ray = cluster.connect(opts.address, "data")
    trace.mark("ray_connected")
    total_gpus = ray.cluster_resources().get("GPU", 0)
    gpus = opts.gpus
    if gpus is None:
        gpus = 1 if total_gpus and device != "cpu" else 0
    if gpus and gpus > total_gpus:
        raise UsageError(f"--gpus-per-replica {gpus:g}: the Ray cluster has {total_gpus:g} GPUs")
    low, high = opts.replicas or ((max(1, int(total_gpus // gpus)),) * 2 if gpus else (1, 1))
    say(f"minicpm: {len(items)} items on Ray: {low if low == high else f'{low}-{high}'} replicas, "
        f"{gpus:g} GPUs each, batches of {batch}")
    # a block per batch (up to MAX_BLOCKS, each an object in Ray's store; beyond, a block holds several
    # whole batches, which map_batches cuts apart again): the batches spread over the pool to the end,
    # in `batches`' order, and an actor that dies takes little finished work with it. (Blocks of any
    # other size would be bundled until they hold `batch` rows and cut anew: other batches.)
    plan = batches(items, batch)
    per = math.ceil(len(plan) / MAX_BLOCKS)
    # (from_blocks keeps the blocks as given and reads their sizes here; from_arrow would run a task
    # a table to read them)
    ds = ray.data.from_blocks([pa.table(_columns([i for group in plan[k : k + per] for i in group]))
                               for k in range(0, len(plan), per)])
    # an actor holds the batch it runs and the next (no wait between two), not more: a batch queued
    # on a busy actor would wait while another actor idles at the end of the job. (An actor that dies
    # is restarted and the batches it held are run again: Ray Data's defaults, max_restarts=-1 and
    # max_task_retries=-1.)
    sizes = {"size": low} if low == high else {"min_size": low, "max_size": high}
    pool = ray.data.ActorPoolStrategy(**sizes, max_tasks_in_flight_per_actor=TASKS_PER_ACTOR)
    env = cache_environment()
    ds = ds.map_batches(speaker_class(load, frames_per_token), batch_size=batch, batch_format="numpy", compute=pool,
                        num_gpus=gpus, **({"runtime_env": {"env_vars": env}} if env else {}))
    trace.mark("ray_dataset")
    yield from ds.iter_batches(batch_size=None, batch_format="numpy")


# -- the run ---------------------------------------------------------------------------------------


@dataclass
class Summary:
    items: int  # in INPUT
    skipped: int  # already complete
    spoken: int
    seconds: float  # of audio spoken in this run
    elapsed: float
    failed: list[tuple[str, str]]  # (id, error)


def run(items: Sequence[Item], out: Path, results: Callable[[Sequence[Item]], Iterable[dict]],
        progress: bool, captions: str | None = None) -> Summary:
    """Speak the items of `items` that are not complete in `out` (resume), writing each file and its
    manifest line as its audio arrives from `results(pending)`; with `captions` ("srt" or "vtt"),
    each item's caption file beside its audio (`<id>.srt`), written before its manifest line."""
    from .. import audio, captions as cc

    t0 = time.monotonic()
    with _lock(out):
        manifest = Manifest(out)
        manifest.tidy()
        extra = [f"{i.id}.{captions}" for i in items] if captions else []
        for name in [MANIFEST] + [i.file for i in items] + extra:  # (temporary files of a run that was killed:
            for tmp in out.glob(f".{glob_escape(name)}.*.partial"):  # nothing else writes here, we hold the lock)
                tmp.unlink(missing_ok=True)
        pending = [i for i in items if not manifest.complete(i, out)
                   or (captions and not (out / f"{i.id}.{captions}").is_file())]
        summary = Summary(len(items), len(items) - len(pending), 0, 0.0, 0.0, [])
        if not pending:
            return summary
        by_id = {i.id: i for i in pending}
        bar = _bar(len(pending)) if progress else None
        try:
            for result in results(pending):
                began = time.time()
                for rid, data, seconds, marks, error in zip(result["id"], result["audio"], result["seconds"],
                                                            result["marks"], result["error"]):
                    item = by_id[str(rid)]
                    if error:
                        summary.failed.append((item.id, str(error)))
                    else:
                        samples = np.frombuffer(data, "<f4")
                        sink = audio.FileSink(str(out / item.file), "s16", SAMPLE_RATE)
                        try:
                            sink.write(samples)
                            sink.close()
                        except BaseException:
                            sink.abort()
                            raise
                        entry = {"id": item.id, "text": item.text, "file": item.file,
                                 "seconds": round(float(seconds), 4), "seed": item.seed,
                                 "voice": item.voice, "voice_digest": item.voice_digest, "speed": item.speed,
                                 "bytes": (out / item.file).stat().st_size}
                        if captions is not None:
                            entry["captions"] = f"{item.id}.{captions}"
                            cues = cc.utterance_cues(len(samples), [tuple(m) for m in json.loads(str(marks))])
                            cc.write(str(out / entry["captions"]), cues, SAMPLE_RATE, captions)
                        manifest.append(entry)
                        summary.spoken += 1
                        summary.seconds += float(seconds)
                    if bar is not None:
                        bar.update(1)
                        elapsed = time.monotonic() - t0
                        bar.set_postfix_str(f"{summary.seconds / elapsed:.2f} s audio/s", refresh=False)
                trace.mark("bulk_written", began=began, items=len(result["id"]))
        finally:
            if bar is not None:
                bar.close()
            manifest.tidy()
    summary.elapsed = time.monotonic() - t0
    return summary


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="speaking", unit=" item", file=sys.stderr, dynamic_ncols=True)
