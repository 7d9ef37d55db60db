"""The `minicpm` command line: a Unix filter with one error boundary.

Audio (the payload) goes to stdout or a file, everything else to stderr. Our exceptions become one
line `minicpm: error: ...` with their exit status; usage mistakes caught by the parser exit 2;
`MINICPM_DEBUG=1` re-raises for a traceback. Heavy modules (torch, the pipeline) are imported inside
the commands so that `--help` stays fast.

`--voice REF` is resolved here, before any model is looked for (`voice_store.resolve`: an existing
file, `default`, else a saved voice); `minicpm voice add|list|rm` manage the saved voices.

`say` and `reply` take their speech from a speaker: the model loaded in this process (`_Local`) or a
running `minicpm serve` (`client.Remote`, found at MINICPM_SERVER, by default the address `serve`
uses), both giving chunks of float32 samples that the same sinks write (a server converts them for
stdout, --raw and 16-bit WAV, as the sink would). Through a server nothing imports torch.

`bulk` speaks a file of items, one audio file each (`bulk.py`); `bulk --ray` and `serve --ray` run on a
Ray cluster (`cluster.py`, `ray_serve.py`), Ray being imported only then.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import __version__, protocol, trace
from .. import backends as registry
from .signals import interrupt, terminate
from ..engine.loading import check_gguf
from ..errors import MinicpmError, OptionError, UsageError

app = typer.Typer(
    name="minicpm",
    help="Text to speech on your own GPU with MiniCPM-o 2.6.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts contain [default: ...], which rich would eat as markup
)

ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Checkpoint directory or Hugging Face repo id [default: the backend's model, openbmb/MiniCPM-o-2_6].")]
BackendOpt = Annotated[str, typer.Option("--backend", "-b", help="LLM-stage backend. " + registry.help_text())]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Say on stderr which backend and device were chosen.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cuda or cpu.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto (bfloat16 on CUDA, float32 on CPU), bfloat16 or float32.")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling (reproducible output).")]
GreedyOpt = Annotated[bool, typer.Option("--greedy", help="Take the most likely code/token everywhere (deterministic).")]
PcmOpt = Annotated[str, typer.Option("--pcm", help="Sample format: s16 (16-bit integer) or f32 (32-bit float, WAV only).")]


OutputOpt = Annotated[Optional[str], typer.Option("--output", "-o", help="Output .wav or .flac file, or - for stdout (the default when stdout is not a terminal).")]
RawOpt = Annotated[bool, typer.Option("--raw", help="Headerless PCM (s16le, or f32le with --pcm f32) instead of WAV.")]
GgufOpt = Annotated[Optional[str], typer.Option("--gguf", help="With --backend gguf: a .gguf file, or REPO[:FILE] on the hub [default: openbmb/MiniCPM-o-2_6-gguf:Model-7.6B-Q4_K_M.gguf].", show_default=False)]
ServerOpt = Annotated[Optional[str], typer.Option("--server", help=f"Speak through the minicpm server at URL (an error if none answers) [default: ${protocol.SERVER_ENV}, else {protocol.DEFAULT_URL} when a server answers there].", show_default=False)]
LocalOpt = Annotated[bool, typer.Option("--local", help="Load the model in this process even if a server is running.")]
VoiceOpt = Annotated[Optional[str], typer.Option("--voice", help="Speak in the voice of a recording (wav, flac, ogg; 0.5-30 s) or of a saved voice (minicpm voice add): an existing file path wins, then a saved name; 'default' is the model's own voice. The model card's voice cloning; needs a checkpoint with the audio encoder. Clone only voices you have the right to use.", show_default=False)]
RayOpt = Annotated[Optional[str], typer.Option("--ray", help="Run on a Ray cluster: auto (the cluster at $RAY_ADDRESS, else one started on this machine with `ray start --head`, else a local Ray for this command only) or a cluster's ADDRESS (HOST:6379 from one of its nodes, ray://HOST:10001 through Ray Client). Needs pip install 'minicpm-cli[ray]'.", show_default=False)]
ReplicasOpt = Annotated[Optional[str], typer.Option("--replicas", help="With --ray: N model replicas, or MIN-MAX to scale between MIN and MAX with the load [default: bulk: as many as the cluster's GPUs hold, 1 without GPUs; serve: 1].", show_default=False)]
GpusOpt = Annotated[Optional[float], typer.Option("--gpus-per-replica", help="With --ray: GPUs each replica holds (a fraction shares a GPU) [default: 1 where the cluster has GPUs and --device is not cpu, else 0].", show_default=False)]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"minicpm {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """Text to speech on your own GPU with MiniCPM-o 2.6."""


FirstChunkOpt = Annotated[Optional[int], typer.Option("--first-chunk", help="Audio frames (of 21.3 ms) in the first streamed chunk, 1-25 [default: 25].", show_default=False)]


def _load(model: Optional[str], backend: str, device: str, dtype: str, gguf: Optional[str] = None,
          verbose: bool = False, rows: int = 1):
    from ..engine import loading

    trace.mark("imported")
    synth, backend, model = loading.load(model, backend, device, dtype, gguf, rows=rows)
    trace.mark("loaded")
    if verbose:
        print(f"minicpm: backend {backend}, device {synth.device}, model {model}", file=sys.stderr)
    return synth


class _Local:
    """The model in this process, behind the interface `client.Remote` offers `say` and `reply` (float
    samples always: `pcm`, the format a raw sink writes, is for a server to convert to)."""

    def __init__(self, synth):
        self.synth, self.sample_rate = synth, synth.sample_rate
        self.voice = None  # --voice: every request of this command speaks in it

    def read(self, text: str, *, greedy: bool, seed: Optional[int], decode: str, first_chunk: int,
             pcm: Optional[str] = None):
        from ..engine.sampling import Sampling

        return self.synth.synthesize(text, Sampling(greedy=greedy, seed=seed), decode=decode, first_chunk=first_chunk,
                                     voice=self.voice)

    def read_many(self, texts, *, batch: int, greedy: bool, seed: Optional[int], decode: str, first_chunk: int):
        """Each text's chunks (a list), in input order, `batch` of them generated at once."""
        from ..engine.batching import in_order
        from ..engine.sampling import Sampling

        sampling = Sampling(greedy=greedy, seed=seed)
        jobs = (self.synth.read_job(t, sampling, voice=self.voice, decode=decode, first_chunk=first_chunk)
                for t in texts)
        return in_order(self.synth.batch(batch), jobs, batch)

    def reply(self, message: str, *, greedy: bool, seed: Optional[int], temperature: float, max_tokens: int,
              first_chunk: int, pcm: Optional[str] = None):
        from ..engine.llm import LLMSampling
        from ..engine.sampling import Sampling

        return self.synth.reply(message, Sampling(greedy=greedy, seed=seed), llm=LLMSampling(temperature=temperature),
                                max_tokens=max_tokens, first_chunk=first_chunk, voice=self.voice)


def _voice(ref: Optional[str]):
    """The voice --voice names (a file or a saved voice), read and checked before any model is looked
    for (no torch); None for the model's own."""
    if ref is None:
        return None
    from ..voices.store import resolve

    return resolve(ref)


def _give_voice(voice, speaker) -> None:
    """Make the speaker speak in `voice`: the model here takes it; a server gets its samples with
    every request."""
    if voice is None:
        return
    if isinstance(speaker, _Local):
        speaker.voice = voice
    else:
        speaker.take_voice(voice)


def _speaker(model: Optional[str], backend: str, device: str, dtype: str, gguf: Optional[str], verbose: bool,
             server: Optional[str], local: bool, rows: int = 1):
    """A running server when one answers (--server URL, else $MINICPM_SERVER or the default address),
    unless --local; otherwise the model loaded here. What the server cannot honour is an error."""
    if local and server is not None:
        raise OptionError("--local and --server do not go together")
    check_gguf(backend, gguf)
    if backend != registry.AUTO:
        registry.get(backend)  # an unknown name is the same error either way
    if not local:
        from ..serving.client import Remote, server_url

        remote = Remote.find(*server_url(server))
        if remote is not None:
            # no model in this process: numpy, where a sink needs it, needs none of OpenBLAS's threads
            # (one a core), whose start took 25-70 ms of numpy's import on the 2-core machine
            os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
            remote.check(model=model, backend=backend, device=device, dtype=dtype, gguf=gguf)
            if verbose:
                print(f"minicpm: {remote.describe()}", file=sys.stderr)
            return remote
    return _Local(_load(model, backend, device, dtype, gguf, verbose, rows))


def _check_sampling(greedy: bool, seed: Optional[int]) -> None:
    if greedy and seed is not None:
        raise OptionError("--greedy takes no --seed: greedy decoding draws nothing (give one or the other)")


def _first_chunk(frames: Optional[int]) -> int:
    if frames is None:
        return protocol.FRAMES_PER_CALL
    if not 1 <= frames <= protocol.FRAMES_PER_CALL:
        raise OptionError(f"--first-chunk must be between 1 and {protocol.FRAMES_PER_CALL} frames")
    return frames


def _output(output: Optional[str]) -> str:
    if output is None:
        if sys.stdout.isatty():
            raise UsageError("refusing to write audio to a terminal: give -o FILE, or pipe the output (-o -)")
        return "-"
    return output


def _read_all(text: Optional[str], file: Optional[str]) -> str:
    if text is not None and file is not None:
        raise OptionError("give the text as an argument or with -f, not both")
    if text is not None:
        return text
    if file is not None and file != "-":
        try:
            return Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read {file}: {e}") from None
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no text: give it as an argument, with -f FILE, or on standard input")
    return sys.stdin.read()


def _lines(file: Optional[str]):
    """Input lines as they arrive (stdin is read line by line, not to the end first)."""
    if file is not None and file != "-":
        try:
            with open(file, encoding="utf-8") as f:
                yield from f
        except OSError as e:
            raise UsageError(f"cannot read {file}: {e}") from None
        return
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("--lines reads standard input or -f FILE")
    yield from iter(sys.stdin.readline, "")


class ReaderGone(Exception):
    """The reader of our stdout closed the pipe (not an OSError, so click leaves it to `main`)."""


def _play(chunks, sink, on_chunk=None) -> None:
    """Write every chunk to the sink as it comes; on any failure or interrupt the sink is discarded."""
    try:
        for chunk in chunks:
            if len(chunk.samples):
                sink.write(chunk.samples)
            if on_chunk:
                on_chunk(chunk)
        sink.close()
    except BrokenPipeError:
        sink.abort()
        raise ReaderGone() from None
    except BaseException:
        sink.abort()
        raise


def _progress():
    """A tqdm bar of audio seconds on stderr when it is a terminal, else None."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(desc="speaking", unit=" s audio", file=sys.stderr, leave=False,
                bar_format="{desc}: {n:.1f}{unit} [{elapsed}, {rate_fmt}]")


@app.command()
def say(
    text: Annotated[Optional[str], typer.Argument(help="Text to speak; read from -f FILE or stdin when omitted.", show_default=False)] = None,
    output: OutputOpt = None,
    file: Annotated[Optional[str], typer.Option("--file", "-f", help="Read the text from FILE (- for stdin).")] = None,
    lines: Annotated[bool, typer.Option("--lines", help="Speak each input line as soon as it arrives.")] = False,
    directory: Annotated[Optional[str], typer.Option("--dir", "-d", help="With --lines: one file per line in DIR (names printed on stderr).")] = None,
    batch: Annotated[int, typer.Option("--batch", help="With --dir: lines generated at once (a batch on the model here, or concurrent requests to a server); each file is still written whole and named in input order.")] = 1,
    raw: RawOpt = False,
    pcm: PcmOpt = "s16",
    first_chunk: FirstChunkOpt = None,
    model: ModelOpt = None,
    backend: BackendOpt = "auto",
    gguf: GgufOpt = None,
    seed: SeedOpt = None,
    greedy: GreedyOpt = False,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    verbose: VerboseOpt = False,
    server: ServerOpt = None,
    local: LocalOpt = False,
    voice: VoiceOpt = None,
) -> None:
    """Read text aloud: to an audio file, or streamed to stdout as it is generated.

    A file gets each segment decoded in one piece (the reference's read-aloud waveform); stdout and
    --raw get audio chunk by chunk as soon as it is generated. A running `minicpm serve` does the
    work when one answers (the same bytes come out); --local loads the model here.
    """
    trace.mark("parsed")
    from .. import audio

    frames = _first_chunk(first_chunk)
    if batch < 1:
        raise OptionError("--batch must be at least 1")
    if batch > 1 and directory is None:
        raise OptionError("--batch reads several lines at once into their own files: use it with --lines --dir")
    if directory is not None:
        if not lines:
            raise OptionError("--dir writes one file per line: use it with --lines")
        if output is not None:
            raise OptionError("give either -o or --dir, not both")
        if not Path(directory).is_dir():
            raise UsageError(f"not a directory: {directory}")
        audio.check_pcm(pcm)
    else:
        output = _output(output)
        audio.check_output(output, pcm, raw)
    whole = None if lines else _read_all(text, file).strip()
    if lines and text is not None:
        raise OptionError("--lines reads standard input or -f FILE, not an argument")
    if whole is not None and not whole:
        raise UsageError("no text to speak")

    _check_sampling(greedy, seed)
    ref = _voice(voice)
    speaker = _speaker(model, backend, device, dtype, gguf, verbose, server, local, rows=batch)
    _give_voice(ref, speaker)
    bar = _progress()
    advance = (lambda c: bar.update(len(c.samples) / c.sample_rate)) if bar else None

    def chunks(t: str, decode: str, target: str):
        # (a server sends the sink's own samples when it writes them as they are)
        return speaker.read(t, greedy=greedy, seed=seed, decode=decode, first_chunk=frames,
                            pcm=pcm if audio.takes_pcm(target, pcm, raw) else None)

    def speak(t: str, target: str, to_file: bool) -> None:
        # (the chunks are asked for before the sink is opened: a server starts on them while opening
        # it may load numpy and libsndfile)
        stream = chunks(t, "segment" if to_file else "stream", target)
        _play(stream, audio.open_sink(target, pcm, speaker.sample_rate, raw), advance)

    try:
        if whole is not None:
            speak(whole, output, output != "-" and not raw)
            trace.mark("written")
        elif directory is not None:
            texts = (line for line in _lines(file) if line.strip())
            decode = "stream" if raw else "segment"
            paths = (str(Path(directory) / f"line-{n:04d}{'.raw' if raw else '.wav'}") for n in itertools.count(1))
            if batch == 1:  # each line's chunks written as they come
                spoken = ((path, chunks(t, decode, path)) for t, path in zip(texts, paths))
            else:
                spoken = zip(paths, speaker.read_many(texts, batch=batch, greedy=greedy, seed=seed, decode=decode,
                                                      first_chunk=frames))
            for path, line_chunks in spoken:
                _play(line_chunks, audio.open_sink(path, pcm, speaker.sample_rate, raw), advance)
                print(path, file=sys.stderr, flush=True)
        else:
            # every line into one stream, each line's chunks as soon as they exist
            every = (chunk for line in _lines(file) if line.strip() for chunk in chunks(line, "stream", output))
            _play(every, audio.open_sink(output, pcm, speaker.sample_rate, raw), advance)
    finally:
        if bar:
            bar.close()


@app.command()
def reply(
    text: Annotated[Optional[str], typer.Argument(help="The user's message; read from stdin when omitted.", show_default=False)] = None,
    output: OutputOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Most LLM tokens in the reply.")] = 512,
    text_out: Annotated[Optional[str], typer.Option("--text-out", help="Write the reply text to FILE instead of stderr.")] = None,
    temperature: Annotated[float, typer.Option("--temperature", help="LLM sampling temperature.")] = 0.7,
    raw: RawOpt = False,
    pcm: PcmOpt = "s16",
    first_chunk: FirstChunkOpt = None,
    model: ModelOpt = None,
    backend: BackendOpt = "auto",
    gguf: GgufOpt = None,
    seed: SeedOpt = None,
    greedy: GreedyOpt = False,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    verbose: VerboseOpt = False,
    server: ServerOpt = None,
    local: LocalOpt = False,
    voice: VoiceOpt = None,
) -> None:
    """Answer a message with speech, streamed as the LLM writes the answer.

    The reply text goes to stderr as it is spoken (or to --text-out FILE); audio goes where `say`
    would put it.
    """
    from .. import audio

    frames = _first_chunk(first_chunk)
    output = _output(output)
    audio.check_output(output, pcm, raw)
    if temperature <= 0:
        raise OptionError("--temperature must be positive (use --greedy for the most likely tokens)")
    if max_tokens < 1:
        raise UsageError("--max-tokens must be at least 1")
    message = _read_all(text, None).strip()
    if not message:
        raise UsageError("no text to reply to")
    if text_out is not None and not Path(text_out).expanduser().resolve().parent.is_dir():
        raise UsageError(f"output directory does not exist: {Path(text_out).parent}")

    _check_sampling(greedy, seed)
    ref = _voice(voice)
    speaker = _speaker(model, backend, device, dtype, gguf, verbose, server, local)
    _give_voice(ref, speaker)
    said: list[str] = []

    def show(chunk) -> None:
        said.append(chunk.text)
        if text_out is None and chunk.text:
            sys.stderr.write(chunk.text)
            sys.stderr.flush()

    chunks = speaker.reply(message, greedy=greedy, seed=seed, temperature=temperature, max_tokens=max_tokens,
                           first_chunk=frames, pcm=pcm if audio.takes_pcm(output, pcm, raw) else None)
    _play(chunks, audio.open_sink(output, pcm, speaker.sample_rate, raw), show)
    if text_out is None:
        sys.stderr.write("\n")
    else:
        Path(text_out).expanduser().write_text("".join(said) + "\n", encoding="utf-8")


def _here(path: Optional[str]) -> Optional[str]:
    """A path that exists here, made absolute (Ray's workers do not run in this directory); anything
    else (a hub repo id) as given."""
    if path is None or not Path(path).expanduser().exists():
        return path
    return str(Path(path).expanduser().resolve())


def _check_ray(ray_address: Optional[str], replicas: Optional[str], gpus: Optional[float]):
    """The --ray address checked, --replicas parsed; both replica options need --ray."""
    if ray_address is None:
        given = [flag for flag, v in (("--replicas", replicas), ("--gpus-per-replica", gpus)) if v is not None]
        if given:
            raise OptionError(f"{' and '.join(given)} need --ray (without it the model runs once, in this process)")
        return None, None
    if gpus is not None and gpus < 0:
        raise OptionError("--gpus-per-replica must be at least 0")
    from ..scale.cluster import check_address, parse_replicas

    try:
        bounds = None if replicas is None else parse_replicas(replicas)
    except ValueError:
        raise OptionError(f"--replicas takes N or MIN-MAX (1 <= MIN <= MAX), not '{replicas}'") from None
    return check_address(ray_address), bounds


@app.command()
def bulk(
    input: Annotated[str, typer.Argument(help="The items: a text file (an item each non-empty line), .jsonl or .parquet (a text column; optional id, voice, seed).", show_default=False)],
    out: Annotated[str, typer.Option("--out", help="Directory for the audio files and manifest.jsonl (made if missing).", show_default=False)],
    ray_address: RayOpt = None,
    replicas: ReplicasOpt = None,
    gpus_per_replica: GpusOpt = None,
    batch: Annotated[int, typer.Option("--batch", help="Items per batch given to a model.")] = 8,
    fmt: Annotated[str, typer.Option("--format", help="Audio files: wav or flac (16-bit).")] = "wav",
    model: ModelOpt = None,
    backend: BackendOpt = "auto",
    gguf: GgufOpt = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Give each item the seed derived from this one and its id (docs/scale-out.md): its audio is then `say --seed <derived>`'s, wherever it runs [default: a seed drawn for the run].", show_default=False)] = None,
    greedy: GreedyOpt = False,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    verbose: VerboseOpt = False,
) -> None:
    """Speak many texts, one audio file each: DIR/<id>.wav and DIR/manifest.jsonl.

    Items without an id are named line-0001, line-0002, ... as `say --lines --dir` names them. A run
    skips the items the manifest lists as complete, so running it again after a crash finishes the
    job. Without --ray the model runs in this process; with --ray, Ray Data runs batches on a pool of
    model replicas across the cluster (the files are written here).
    """
    from ..scale import bulk as b

    if fmt not in b.FORMATS:
        raise OptionError(f"--format must be wav or flac, not '{fmt}'")
    if batch < 1:
        raise OptionError("--batch must be at least 1")
    _check_sampling(greedy, seed)
    check_gguf(backend, gguf)
    if backend != registry.AUTO:
        registry.get(backend)
    address, bounds = _check_ray(ray_address, replicas, gpus_per_replica)
    if address is not None:
        from ..scale.cluster import require_ray

        require_ray("data")
    path = Path(input).expanduser()
    if not path.is_file():
        raise UsageError(f"no such file: {input}")
    items = b.plan(b.read_rows(path), fmt=fmt, greedy=greedy, seed=seed, base=path.resolve().parent)
    if not items:
        raise UsageError(f"no items in {input}")
    b.check_voices(items)
    directory = Path(out).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot make the directory {out}: {e.strerror or e}") from None
    if address is not None:
        model, gguf = _here(model), _here(gguf)
    load = functools.partial(_load, model, backend, device, dtype, gguf, verbose, batch)  # (rows: a batch at once)
    if address is None:
        def results(pending):
            return b.in_process(pending, load, batch)
    else:
        say = (lambda line: print(line, file=sys.stderr, flush=True)) if verbose else (lambda line: None)
        opts = b.RayOptions(address, bounds, gpus_per_replica)

        def results(pending):
            return b.on_ray(pending, load, batch, opts, device, say)
    try:
        summary = b.run(items, directory, results, progress=sys.stderr.isatty())
    finally:
        if address is not None:
            from ..scale.cluster import disconnect

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


@app.command()
def serve(
    model: ModelOpt = None,
    backend: BackendOpt = "auto",
    gguf: GgufOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    host: Annotated[str, typer.Option("--host", help="Address to listen on; one reachable from other machines needs --api-key (or --insecure).")] = protocol.DEFAULT_HOST,
    port: Annotated[int, typer.Option("--port", "-p", help="Port to listen on (0: any free port, named in the ready line).")] = protocol.DEFAULT_PORT,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar=protocol.API_KEY_ENV, help="Require 'Authorization: Bearer KEY' on every request but GET /health.", show_default=False)] = None,
    insecure: Annotated[bool, typer.Option("--insecure", help="Serve a non-loopback --host without an API key.")] = False,
    random_weights: Annotated[bool, typer.Option("--random-weights", help="For speed work (`bench --server`): the full-size model with random weights drawn on the device, no checkpoint; lengths forced as `bench --random-weights` forces them. Its audio is noise.")] = False,
    batch: Annotated[int, typer.Option("--batch", help="Requests generated at once (continuous batching); more queue. Each holds its own KV caches: ~0.24 GB of GPU memory a request in bfloat16. The gguf backend runs one at a time.")] = 8,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every request on stderr.")] = False,
    ray_address: RayOpt = None,
    replicas: ReplicasOpt = None,
    gpus_per_replica: GpusOpt = None,
) -> None:
    """Load the model once and serve it: an OpenAI-compatible speech API (POST /v1/audio/speech), spoken
    replies (POST /v1/audio/reply), saved voices (GET/POST /v1/voices), GET /health. Runs until SIGTERM
    or Ctrl-C, then finishes the requests in flight and exits 0.

    One line on stderr says when it is ready. `say` and `reply` use it when it runs at their default
    address (else set MINICPM_SERVER or give --server URL). With --ray the same application runs on
    Ray Serve: --replicas model replicas behind Serve's HTTP proxy at --host/--port.
    """
    if not 0 <= port <= 65535:
        raise OptionError("--port must be between 0 and 65535")
    if batch < 1:
        raise OptionError("--batch must be at least 1")
    address, bounds = _check_ray(ray_address, replicas, gpus_per_replica)
    api_key = api_key or None
    from ..serving import server as srv

    if not srv.is_loopback(host) and api_key is None and not insecure:
        raise OptionError(f"--host {host} can be reached from other machines: give --api-key KEY (or set "
                          f"{protocol.API_KEY_ENV}), or --insecure to serve it without a key")
    check_gguf(backend, gguf)
    if backend != registry.AUTO:
        be = registry.get(backend)
        if address is None:  # (with --ray, what counts is what the replicas have installed)
            be.check()

    if address is not None:
        from ..scale import cluster

        cluster.require_ray("serve")
        from ..scale import ray_serve

        args = ray_serve.ServeArgs(model=_here(model), backend=backend, gguf=_here(gguf), device=device, dtype=dtype,
                                   random_weights=random_weights, batch=batch, api_key=api_key, replicas=bounds or (1, 1),
                                   gpus=gpus_per_replica)
        ray_serve.deploy(args, address=address, host=host, port=port)
        return
    srv.run(srv.ServeOptions(host=host, port=port, api_key=api_key, verbose=verbose),
            functools.partial(srv.load_served, model, backend, device, dtype, gguf, random_weights, batch))


@app.command()
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
) -> None:
    """Benchmark backends: time to first audio, real-time factor, per-stage costs (table on stdout)."""
    if concurrency is not None and (concurrency < 1 or startup or voice is not None):
        raise OptionError("--concurrency takes a number of streams of at least 1, and neither --startup nor --voice")
    if voice is not None:
        if startup or server is not None:
            raise OptionError("--voice times voice cloning on a model loaded here: not with --startup or --server")
        from ..voices.reference import Voice

        Voice.load(voice)  # (a file that cannot be a voice is refused before anything loads)
    if startup:
        if model is None or random_weights or server is not None:
            raise OptionError("--startup needs --model DIR (a checkpoint directory), without --random-weights or --server")
        names = tuple(b.strip() for b in backend.split(",") if b.strip()) if backend else \
            tuple(n for n, b in registry.REGISTRY.items() if b.available() and n != "gguf")
        for name in names:
            registry.get(name).check()
        from . import startup as s

        runs_ = s.run(model, names, device)
        if json_out:
            Path(json_out).write_text(json.dumps([vars(r) for r in runs_], indent=1) + "\n")
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
        raise UsageError("--backend needs at least one name")
    for name in names:
        registry.get(name).check()
    check_gguf(",".join(names), gguf)
    workloads = {"read": ("read",), "reply": ("reply",), "bulk": ("bulk",),
                 "all": ("read", "reply") + (("bulk",) if concurrency and server is None else ())}.get(workload)
    if workloads is None:
        raise UsageError(f"unknown workload '{workload}' (read, reply, bulk or all)")
    if workloads == ("bulk",) and concurrency is None:
        raise OptionError("--workload bulk measures batches: give --concurrency N")
    if "bulk" in workloads and server is not None:
        raise OptionError("--workload bulk runs here (say --lines --dir --batch); against --server use read or reply")
    if runs < 1 or warmup < 0:
        raise OptionError("--runs must be at least 1 and --warmup at least 0")
    if json_out is not None and not Path(json_out).expanduser().resolve().parent.is_dir():
        raise UsageError(f"output directory does not exist: {Path(json_out).parent}")
    from . import bench as b

    opts = b.BenchOptions(backends=names, workloads=workloads, runs=runs, warmup=warmup,
                          random_weights=random_weights, model=model, device=device, dtype=dtype,
                          max_tokens=max_tokens, first_chunk=_first_chunk(first_chunk), gguf=gguf, server=server,
                          concurrency=concurrency, voice=voice)
    result = b.run(opts) if concurrency is None else b.concurrent(opts)
    if json_out:
        b.write_json(result, json_out)
    sys.stdout.write(b.table(result) if concurrency is None else b.concurrency_table(result))


voice_app = typer.Typer(
    help="Saved voices: recordings kept under a name, for --voice NAME and a server's voice field.",
    no_args_is_help=True,
)
app.add_typer(voice_app, name="voice")


@voice_app.command("add")
def voice_add(
    name: Annotated[str, typer.Argument(help="The voice's name: letters, digits, - and _.", show_default=False)],
    file: Annotated[str, typer.Argument(help="A recording of the voice (wav, flac, ogg; 0.5-30 s).", show_default=False)],
    force: Annotated[bool, typer.Option("--force", help="Replace a saved voice of that name.")] = False,
) -> None:
    """Save a recording's voice as NAME (its 16 kHz samples, as --voice FILE reads them). Clone only
    voices you have the right to use."""
    from ..voices.store import VoiceStore

    store = VoiceStore()
    saved = store.add(name, file, force=force)
    print(f"minicpm: saved voice '{saved.name}' ({saved.seconds:.1f} s) in {store.root}", file=sys.stderr)


@voice_app.command("list")
def voice_list() -> None:
    """List the saved voices: name, seconds, when added, what from (a table on stdout)."""
    from ..errors import VoiceError
    from ..voices.store import VoiceStore

    store = VoiceStore()
    rows = []
    for name in store.names():
        try:
            v = store.get(name)
        except VoiceError as e:  # (one unreadable file does not hide the others)
            print(f"minicpm: warning: {e}", file=sys.stderr)
            continue
        added = v.added.astimezone().strftime("%Y-%m-%d %H:%M") if v.added else "-"
        rows.append((v.name, f"{v.seconds:.1f}", added, v.source or "-"))
    if not rows:
        print(f"minicpm: no saved voices in {store.root} (minicpm voice add NAME FILE)", file=sys.stderr)
        return
    rows.insert(0, ("NAME", "SECONDS", "ADDED", "FROM"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        sys.stdout.write(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}\n")


@voice_app.command("rm")
def voice_rm(name: Annotated[str, typer.Argument(help="The saved voice to remove.", show_default=False)]) -> None:
    """Remove a saved voice."""
    from ..voices.store import VoiceStore

    VoiceStore().remove(name)


@app.command("backends")
def list_backends() -> None:
    """List the LLM-stage backends: what each is, what it costs, whether it is installed."""
    import shutil
    import textwrap

    width, indent = min(shutil.get_terminal_size((100, 24)).columns, 100), " " * 9
    for b in registry.REGISTRY.values():
        state = "" if b.available() else f"  [not installed: pip install 'minicpm-cli[{b.extra}]']"
        typer.echo(textwrap.fill(f"{b.name:8s} {b.summary}{state}", width, subsequent_indent=indent))
        typer.echo(textwrap.fill(b.cost, width, initial_indent=indent, subsequent_indent=indent))


def main() -> None:
    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, interrupt)  # (typer turns the KeyboardInterrupt into exit status 130)
    try:
        app()
    except MinicpmError as e:
        if os.environ.get("MINICPM_DEBUG"):
            raise
        message = " ".join(str(e).split())  # always one line, whatever the exception text holds
        print(f"minicpm: error: {message}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except (ReaderGone, BrokenPipeError):
        # The reader went away (e.g. `| head`): not an error. Point stdout at devnull so the
        # interpreter's final flush does not complain.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(0)
    finally:
        # The work is done or undone: an interrupt while the interpreter shuts down has nothing left
        # to stop, and Python's own handler would be back by then (killed by SIGINT, no message).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
