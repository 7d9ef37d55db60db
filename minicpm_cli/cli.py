"""The `minicpm` command line: a Unix filter with one error boundary.

Audio (the payload) goes to stdout or a file, everything else to stderr. Our exceptions become one
line `minicpm: error: ...` with their exit status; usage mistakes caught by the parser exit 2;
`MINICPM_DEBUG=1` re-raises for a traceback. Heavy modules (torch, the pipeline) are imported inside
the commands so that `--help` stays fast.

`say` and `reply` take their speech from a speaker: the model loaded in this process (`_Local`) or a
running `minicpm serve` (`client.Remote`, found at MINICPM_SERVER, by default the address `serve`
uses), both giving chunks of float32 samples that the same sinks write (a server converts them for
stdout, --raw and 16-bit WAV, as the sink would). Through a server nothing imports torch.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from . import __version__, protocol, trace
from . import backends as registry
from .entry import interrupt
from .errors import MinicpmError, OptionError, UsageError

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
VoiceOpt = Annotated[Optional[str], typer.Option("--voice", help="Speak in the voice of this recording (wav, flac, ogg; 0.5-30 s): the model card's voice cloning. Needs a checkpoint with the audio encoder, and --local while a server runs (the server does not take voices yet). Clone only voices you have the right to use.", show_default=False)]


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


def _pick(model: Optional[str], backend: str, device: str, gguf: Optional[str]) -> tuple[str, str]:
    """(the backend `auto` stands for here, the model to load: the backend's default when none is given)."""
    _check_gguf(backend, gguf)
    if backend != registry.AUTO:
        registry.get(backend).check()
    from .pipeline import resolve_device

    if backend == registry.AUTO:
        backend = registry.choose(model, resolve_device(device).type, gguf=gguf)
    be = registry.get(backend)
    be.check()
    return backend, model or be.default_model


def _load(model: Optional[str], backend: str, device: str, dtype: str, gguf: Optional[str] = None,
          verbose: bool = False):
    backend, model = _pick(model, backend, device, gguf)
    from .pipeline import Synthesizer

    trace.mark("imported")
    synth = Synthesizer.load(model, backend=backend, device=device, dtype=dtype, gguf=gguf)
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
        from .sampling import Sampling

        return self.synth.synthesize(text, Sampling(greedy=greedy, seed=seed), decode=decode, first_chunk=first_chunk,
                                     voice=self.voice)

    def reply(self, message: str, *, greedy: bool, seed: Optional[int], temperature: float, max_tokens: int,
              first_chunk: int, pcm: Optional[str] = None):
        from .llm import LLMSampling
        from .sampling import Sampling

        return self.synth.reply(message, Sampling(greedy=greedy, seed=seed), llm=LLMSampling(temperature=temperature),
                                max_tokens=max_tokens, first_chunk=first_chunk, voice=self.voice)


def _voice(path: Optional[str]):
    """The reference of --voice, read and checked before any model is looked for (no torch)."""
    if path is None:
        return None
    from .voice import Voice

    return Voice.load(path)


def _give_voice(ref, speaker) -> None:
    """Make the speaker speak in `ref` (the model in this process only, for now)."""
    if ref is None:
        return
    if not isinstance(speaker, _Local):
        raise UsageError("the server does not take --voice yet: add --local to clone the voice in this process")
    speaker.voice = ref


def _speaker(model: Optional[str], backend: str, device: str, dtype: str, gguf: Optional[str], verbose: bool,
             server: Optional[str], local: bool):
    """A running server when one answers (--server URL, else $MINICPM_SERVER or the default address),
    unless --local; otherwise the model loaded here. What the server cannot honour is an error."""
    if local and server is not None:
        raise OptionError("--local and --server do not go together")
    _check_gguf(backend, gguf)
    if backend != registry.AUTO:
        registry.get(backend)  # an unknown name is the same error either way
    if not local:
        from .client import Remote, server_url

        remote = Remote.find(*server_url(server))
        if remote is not None:
            # no model in this process: numpy, where a sink needs it, needs none of OpenBLAS's threads
            # (one a core), whose start took 25-70 ms of numpy's import on the 2-core machine
            os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
            remote.check(model=model, backend=backend, device=device, dtype=dtype, gguf=gguf)
            if verbose:
                print(f"minicpm: {remote.describe()}", file=sys.stderr)
            return remote
    return _Local(_load(model, backend, device, dtype, gguf, verbose))


def _check_gguf(backend: str, gguf: Optional[str]) -> None:
    if gguf is not None and not {"gguf", registry.AUTO} & set(backend.split(",")):
        raise OptionError("--gguf is for --backend gguf")


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
    from . import audio

    frames = _first_chunk(first_chunk)
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
    speaker = _speaker(model, backend, device, dtype, gguf, verbose, server, local)
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
            count = 0
            for line in _lines(file):
                if line.strip():
                    count += 1
                    path = str(Path(directory) / f"line-{count:04d}{'.raw' if raw else '.wav'}")
                    speak(line, path, not raw)
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
    from . import audio

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
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every request on stderr.")] = False,
) -> None:
    """Load the model once and serve it: an OpenAI-compatible speech API (POST /v1/audio/speech), spoken
    replies (POST /v1/audio/reply), GET /health. Runs until SIGTERM or Ctrl-C, then finishes the
    requests in flight and exits 0.

    One line on stderr says when it is ready. `say` and `reply` use it when it runs at their default
    address (else set MINICPM_SERVER or give --server URL).
    """
    if not 0 <= port <= 65535:
        raise OptionError("--port must be between 0 and 65535")
    api_key = api_key or None
    from . import server as srv

    if not srv.is_loopback(host) and api_key is None and not insecure:
        raise OptionError(f"--host {host} can be reached from other machines: give --api-key KEY (or set "
                          f"{protocol.API_KEY_ENV}), or --insecure to serve it without a key")
    _check_gguf(backend, gguf)
    if backend != registry.AUTO:
        registry.get(backend).check()

    def load() -> srv.Loaded:
        name, model_id = _pick(model, backend, device, gguf)
        from .bench import FORCED_FRAMES_PER_TOKEN, FORCED_REPLY_TOKENS, environment
        from .pipeline import Synthesizer

        synth = Synthesizer.load(model if random_weights else model_id, backend=name, device=device, dtype=dtype,
                                 gguf=gguf, random_weights=random_weights)
        path = Path(model_id).expanduser()
        return srv.Loaded(synth, model="random-weights" if random_weights else model_id, backend=name,
                          device=str(synth.device), dtype=str(synth.tts.dtype).removeprefix("torch."),
                          path=str(path.resolve()) if path.is_dir() and not random_weights else None, gguf=gguf,
                          environment=environment(synth.device),
                          frames_per_token=FORCED_FRAMES_PER_TOKEN if random_weights else None,
                          reply_tokens=FORCED_REPLY_TOKENS if random_weights else None)

    srv.run(srv.ServeOptions(host=host, port=port, api_key=api_key, verbose=verbose), load)


@app.command()
def bench(
    backend: Annotated[Optional[str], typer.Option("--backend", "-b", help="Comma-separated backends to compare [default: every backend whose dependencies are installed].", show_default=False)] = None,
    workload: Annotated[str, typer.Option("--workload", help="read (say of 3 texts), reply (6 prompts) or all.")] = "all",
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
) -> None:
    """Benchmark backends: time to first audio, real-time factor, per-stage costs (table on stdout)."""
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
    _check_gguf(",".join(names), gguf)
    workloads = {"read": ("read",), "reply": ("reply",), "all": ("read", "reply")}.get(workload)
    if workloads is None:
        raise UsageError(f"unknown workload '{workload}' (read, reply or all)")
    if runs < 1 or warmup < 0:
        raise OptionError("--runs must be at least 1 and --warmup at least 0")
    if json_out is not None and not Path(json_out).expanduser().resolve().parent.is_dir():
        raise UsageError(f"output directory does not exist: {Path(json_out).parent}")
    from . import bench as b

    opts = b.BenchOptions(backends=names, workloads=workloads, runs=runs, warmup=warmup,
                          random_weights=random_weights, model=model, device=device, dtype=dtype,
                          max_tokens=max_tokens, first_chunk=_first_chunk(first_chunk), gguf=gguf, server=server)
    result = b.run(opts)
    if json_out:
        b.write_json(result, json_out)
    sys.stdout.write(b.table(result))


@app.command("backends")
def list_backends() -> None:
    """List the LLM-stage backends: what each is, what it costs, whether it is installed."""
    for b in registry.REGISTRY.values():
        state = "" if b.available() else f"  [not installed: pip install 'minicpm-cli[{b.extra}]']"
        typer.echo(f"{b.name:8s} {b.summary}{state}")
        typer.echo(f"{'':8s} {b.cost}")


def _terminate(signum, frame):
    # SystemExit unwinds like an exception, so sinks discard their partial files on `kill`.
    raise SystemExit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGTERM, _terminate)
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
