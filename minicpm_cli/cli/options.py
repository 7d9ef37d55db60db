"""What the commands share: their options (typer `Annotated` aliases, reused across commands as the
`hf` CLI does) and the checks of option values that more than one command makes.

Checks raise `OptionError` (exit 2) for a value out of range or options that do not go together,
`UsageError` (exit 1) for input that cannot be used. Nothing here imports torch.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import backends as registry
from .. import protocol
from ..engine.loading import check_gguf
from ..errors import OptionError, UsageError

ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Checkpoint directory or Hugging Face repo id [default: the backend's model, openbmb/MiniCPM-o-2_6].")]
BackendOpt = Annotated[str, typer.Option("--backend", "-b", help="LLM-stage backend. " + registry.help_text())]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Say on stderr which backend and device were chosen.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cuda or cpu.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto (bfloat16 on CUDA, float32 on CPU), bfloat16 or float32.")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling (reproducible output).")]
GreedyOpt = Annotated[bool, typer.Option("--greedy", help="Take the most likely code/token everywhere (deterministic).")]
PcmOpt = Annotated[str, typer.Option("--pcm", help="Sample format: s16 (16-bit integer) or f32 (32-bit float, WAV only).")]
CaptionsOpt = Annotated[Optional[str], typer.Option("--captions", help="Also write captions to FILE.srt or FILE.vtt: a cue per text piece, timed by the audio's samples.", show_default=False)]
OutputOpt = Annotated[Optional[str], typer.Option("--output", "-o", help="Output .wav or .flac file, or - for stdout (the default when stdout is not a terminal); a named pipe or a device (/dev/stdout) is written as stdout is.")]
RawOpt = Annotated[bool, typer.Option("--raw", help="Headerless PCM (s16le, or f32le with --pcm f32) instead of WAV.")]
GgufOpt = Annotated[Optional[str], typer.Option("--gguf", help="With --backend gguf: a .gguf file, or REPO[:FILE] on the hub [default: openbmb/MiniCPM-o-2_6-gguf:Model-7.6B-Q4_K_M.gguf].", show_default=False)]
ServerOpt = Annotated[Optional[str], typer.Option("--server", help=f"Speak through the minicpm server at URL (an error if none answers) [default: ${protocol.SERVER_ENV}, else {protocol.DEFAULT_URL} when a server answers there].", show_default=False)]
LocalOpt = Annotated[bool, typer.Option("--local", help="Load the model in this process even if a server is running.")]
VoiceOpt = Annotated[Optional[str], typer.Option("--voice", help="Speak in the voice of a recording (wav, flac, ogg; 0.5-30 s) or of a saved voice (minicpm voice add): an existing file path wins, then a saved name; 'default' is the model's own voice. The model card's voice cloning; needs a checkpoint with the audio encoder. Clone only voices you have the right to use.", show_default=False)]
RayOpt = Annotated[Optional[str], typer.Option("--ray", help="Run on a Ray cluster: auto (the cluster at $RAY_ADDRESS, else one started on this machine with `ray start --head`, else a local Ray for this command only) or a cluster's ADDRESS (HOST:6379 from one of its nodes, ray://HOST:10001 through Ray Client). Needs pip install 'minicpm-cli[ray]'.", show_default=False)]
ReplicasOpt = Annotated[Optional[str], typer.Option("--replicas", help="With --ray: N model replicas, or MIN-MAX to scale between MIN and MAX with the load [default: bulk: as many as the cluster's GPUs hold, 1 without GPUs; serve: 1].", show_default=False)]
GpusOpt = Annotated[Optional[float], typer.Option("--gpus-per-replica", help="With --ray: GPUs each replica holds (a fraction shares a GPU) [default: 1 where the cluster has GPUs and --device is not cpu, else 0].", show_default=False)]
BatchVariantOpt = Annotated[bool, typer.Option("--batch-variant", help="Faster kernels for batches of requests whose rounding depends on the batch: a request's audio may then differ with what else runs at the time (compile and int4 on a GPU). By default the same request gives the same audio alone and in any batch.")]
SpeedOpt = Annotated[float, typer.Option("--speed", help=f"Tempo, {protocol.SPEED_RANGE[0]:g}-{protocol.SPEED_RANGE[1]:g} (2 twice as fast), the pitch kept: the mel is resampled in time before the vocoder.")]
FirstChunkOpt = Annotated[Optional[int], typer.Option("--first-chunk", help="Audio frames (of 21.3 ms) in the first streamed chunk, 1-25 [default: 25].", show_default=False)]


@dataclass(frozen=True)
class SpeakerOptions:
    """The options `say` and `reply` share: how the audio is written, which model speaks and where
    (here or through a server), how it samples, in which voice."""

    raw: bool = False
    pcm: str = "s16"
    first_chunk: Optional[int] = None
    model: Optional[str] = None
    backend: str = "auto"
    gguf: Optional[str] = None
    seed: Optional[int] = None
    greedy: bool = False
    device: str = "auto"
    dtype: str = "auto"
    verbose: bool = False
    server: Optional[str] = None
    local: bool = False
    voice: Optional[str] = None
    batch_variant: bool = False
    speed: float = 1.0


# (name, typer annotation) of each SpeakerOptions field, in the order `--help` lists them
_SPEAKER_PARAMS = (("raw", RawOpt), ("pcm", PcmOpt), ("first_chunk", FirstChunkOpt), ("model", ModelOpt),
                   ("backend", BackendOpt), ("gguf", GgufOpt), ("seed", SeedOpt), ("greedy", GreedyOpt),
                   ("device", DeviceOpt), ("dtype", DtypeOpt), ("verbose", VerboseOpt), ("server", ServerOpt),
                   ("local", LocalOpt), ("voice", VoiceOpt), ("batch_variant", BatchVariantOpt),
                   ("speed", SpeedOpt))


def with_speaker_options(command):
    """Give a command the options of `SpeakerOptions` after its own: typer sees them as parameters,
    the command gets them as one `opts` argument (typer has no option groups of its own)."""
    sig = inspect.signature(command, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "opts"]
    defaults = SpeakerOptions()
    shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=getattr(defaults, name), annotation=ann)
              for name, ann in _SPEAKER_PARAMS]

    @functools.wraps(command)
    def run(**kwargs):
        opts = SpeakerOptions(**{name: kwargs.pop(name) for name, _ in _SPEAKER_PARAMS})
        return command(**kwargs, opts=opts)

    run.__signature__ = sig.replace(parameters=own + shared)
    run.__annotations__ = {p.name: p.annotation for p in own + shared}
    return run


DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("auto", "bfloat16", "bf16", "float32", "fp32")


def check_model_options(backend: str, device: str, dtype: str, gguf: Optional[str]) -> None:
    """--backend (one name, or several where `bench` compares them), --device, --dtype and --gguf
    checked before anything is looked for or loaded: a value out of range exits 2."""
    for name in backend.split(","):
        if name.strip() != registry.AUTO:
            registry.get(name.strip())
    if device not in DEVICES and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise OptionError(f"unknown --device '{device}' (use auto, cuda, cuda:N or cpu)")
    if dtype not in DTYPES:
        raise OptionError(f"unknown --dtype '{dtype}' (use auto, bfloat16 or float32)")
    check_gguf(backend, gguf)


def check_sampling(greedy: bool, seed: Optional[int]) -> None:
    if greedy and seed is not None:
        raise OptionError("--greedy takes no --seed: greedy decoding draws nothing (give one or the other)")
    low, high = protocol.SEED_RANGE
    if seed is not None and not low <= seed <= high:
        raise OptionError(f"--seed must be between {low} and {high}")


def check_speed(speed: float) -> float:
    """--speed, checked: within protocol.SPEED_RANGE (exit 2 otherwise)."""
    low, high = protocol.SPEED_RANGE
    if not low <= speed <= high:
        raise OptionError(f"--speed must be between {low:g} and {high:g}")
    return speed


def chunk_frames(frames: Optional[int]) -> int:
    """--first-chunk's frames, checked (the default: a whole generation call)."""
    if frames is None:
        return protocol.FRAMES_PER_CALL
    if not 1 <= frames <= protocol.FRAMES_PER_CALL:
        raise OptionError(f"--first-chunk must be between 1 and {protocol.FRAMES_PER_CALL} frames")
    return frames


def output_target(output: Optional[str]) -> str:
    """-o's target: stdout (-) when none is given and stdout is not a terminal."""
    if output is None:
        if sys.stdout is None:  # (`>&-`)
            raise UsageError("standard output is closed: give -o FILE")
        if sys.stdout.isatty():
            raise UsageError("refusing to write audio to a terminal: give -o FILE, or pipe the output (-o -)")
        return "-"
    return output


def check_not_voice(output: str, voice: Optional[str]) -> None:
    """-o naming the very file --voice reads (the recording would be replaced by the speech): refused
    before any work (exit 2)."""
    if voice is None or output == "-":
        return
    try:
        same = os.path.samefile(Path(output).expanduser(), Path(voice).expanduser())
    except (OSError, ValueError):  # (either not there: no recording to lose)
        return
    if same:
        raise OptionError(f"-o {output} is the --voice recording, which the speech would replace: "
                          "write the audio to another file")


def absolute_if_here(path: Optional[str]) -> Optional[str]:
    """A path that exists here, made absolute (Ray's workers do not run in this directory); anything
    else (a hub repo id) as given."""
    if path is None or not Path(path).expanduser().exists():
        return path
    return str(Path(path).expanduser().resolve())


def check_ray(ray_address: Optional[str], replicas: Optional[str], gpus: Optional[float]):
    """(the --ray address checked, --replicas parsed); both replica options need --ray."""
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
