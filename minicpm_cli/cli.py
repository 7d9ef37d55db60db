"""The `minicpm` command line: a Unix filter with one error boundary.

Audio (the payload) goes to stdout or a file, everything else to stderr. Our exceptions become one
line `minicpm: error: ...` with their exit status; usage mistakes caught by the parser exit 2;
`MINICPM_DEBUG=1` re-raises for a traceback. Heavy modules (torch, the pipeline) are imported inside
the commands so that `--help` stays fast.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer

from .errors import MinicpmError, UsageError

app = typer.Typer(
    name="minicpm",
    help="Text to speech on your own GPU with MiniCPM-o 2.6.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Checkpoint directory or Hugging Face repo id [default: the backend's model, openbmb/MiniCPM-o-2_6].")]
BackendOpt = Annotated[str, typer.Option("--backend", "-b", help="LLM-stage backend (see `minicpm backends`).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cuda or cpu.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto (bfloat16 on CUDA, float32 on CPU), bfloat16 or float32.")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling (reproducible output).")]
GreedyOpt = Annotated[bool, typer.Option("--greedy", help="Take the most likely code/token everywhere (deterministic).")]
PcmOpt = Annotated[str, typer.Option("--pcm", help="Sample format: s16 (16-bit integer) or f32 (32-bit float, WAV only).")]


def _stderr_is_tty() -> bool:
    return sys.stderr.isatty()


def _read_text(text: Optional[str]) -> str:
    if text is not None:
        return text
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no text: give it as an argument or on standard input")
    return sys.stdin.read()


@app.command()
def say(
    text: Annotated[Optional[str], typer.Argument(help="Text to speak; read from stdin when omitted.", show_default=False)] = None,
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="Output .wav or .flac file, or - for stdout.")] = None,
    model: ModelOpt = None,
    backend: BackendOpt = "eager",
    seed: SeedOpt = None,
    greedy: GreedyOpt = False,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    pcm: PcmOpt = "s16",
) -> None:
    """Read TEXT aloud into an audio file (or stdout)."""
    from . import audio

    if output is None:
        if sys.stdout.isatty():
            raise UsageError("refusing to write audio to a terminal: give -o FILE, or pipe stdout (-o -)")
        output = "-"
    audio.check_output(output, pcm)
    text = _read_text(text).strip()  # `echo text |` must speak the same as the argument "text"
    if not text:
        raise UsageError("no text to speak")

    import backends as registry

    be = registry.get(backend)
    be.check()
    from .pipeline import Synthesizer
    from .sampling import Sampling

    synth = Synthesizer.load(model or be.default_model, backend=backend, device=device, dtype=dtype)
    bar = None
    if _stderr_is_tty():
        from tqdm import tqdm

        bar = tqdm(desc="speaking", unit=" frames", file=sys.stderr, leave=False)
    try:
        utt = synth.say(text, Sampling(greedy=greedy, seed=seed), progress=bar.update if bar else None)
    finally:
        if bar:
            bar.close()
    audio.write(output, utt.audio, utt.sample_rate, pcm)


@app.command("backends")
def list_backends() -> None:
    """List the LLM-stage backends."""
    import backends as registry

    for b in registry.REGISTRY.values():
        extra = f" (extra: {b.extra})" if b.extra else ""
        typer.echo(f"{b.name:8s} {b.summary}{extra}")


def main() -> None:
    try:
        app()
    except MinicpmError as e:
        if os.environ.get("MINICPM_DEBUG"):
            raise
        message = " ".join(str(e).split())  # always one line, whatever the exception text holds
        print(f"minicpm: error: {message}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("minicpm: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): not an error. Point stdout at devnull so the
        # interpreter's final flush does not complain.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(0)
