"""The speech path: text -> LLM speaker state -> TTS codes -> DVAE + Vocos -> 24 kHz audio.

`Synthesizer.load(...)` builds every stage from a checkpoint in the official layout; `say(text)`
runs the reference's read-aloud path (spec §4.3) on the caller's text. The LLM stage is whatever
backend was named; the TTS head, DVAE and Vocos are shared by all backends. The CLI is a thin layer
over this module.

A `voice` (16 kHz samples or a `voice.Voice`) clones a reference voice: its audio embeddings go into
the LLM context (the reference's voice-cloning prompt for a read, its audio-assistant prompt for a
reply), and the speaker vector taken at `<|spk|>` carries it to every segment. The audio encoder is
loaded when a voice is first used (with random weights: drawn then, from the same seed); without a
voice nothing of it is loaded, drawn or run.

A `speed` (0.25-4, protocol.SPEED_RANGE) changes the tempo, not the pitch: the codes are the same
as at speed 1, and the codec resamples their mel in time before Vocos (codec.py). Speed 1 is the
plain path, bit for bit.

Over the house's ~450 lines because it is one thing, the algorithm read top to bottom: loading the
stages, the read path, the reply path and their batched forms, each a few lines over the runners.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from .. import backends

from . import memory
from .checkpoint import DEFAULT_MODEL, Checkpoint, load_module, read_config, resolve
from .cloning import AUDIO_PREFIXES, VoiceEncoder, load_voice_encoder
from .. import protocol, trace
from .codec import Codec, samples_at
from ..errors import CheckpointError, DeviceError, UsageError, unicode_text
from .features import FeatureConfig
from ..models.chattts import ChatTTS, TTSConfig, fold_weight_norm
from .codec import StreamDecoder
from .llm import LLMSampling, reply_pieces
from .sampling import Sampling
from .streaming import FLUSH, Frames, NewSegment, SegmentEnd, StreamingTTS, read_cut, reply_cut
from .text import Arrival, Tokenizers, read_pieces, read_prompt, ready_parts
from .tts import FRAMES_PER_CALL, TTSRunner
from ..voices.reference import Voice, as_voice

if TYPE_CHECKING:
    from .batching import Job

SAMPLE_RATE = 24000
BUNDLED_TOKENIZERS = Path(__file__).parents[1] / "data" / "tiny-tokenizers"
LLM_CONTEXT = 4096
# The voice turns' LLM contexts kept (`voice_context`): a 10-s voice's read turn is ~265 tokens,
# 15 MB of the 7B's bfloat16 KV cache, so ~34 of them; a 30-s one is ~44 MB.
PREFIX_BYTES = 512 << 20


@dataclass(frozen=True)
class AudioChunk:
    samples: np.ndarray  # float32 mono
    sample_rate: int
    text: str  # the text read since the previous chunk (the reply text, for `reply`)
    codes: Tensor  # (k, num_vq) audio frames generated since the previous chunk, on the CPU
    segment: int  # 0 for the first segment; continuations count up
    final: bool = False  # the last chunk of the stream
    # (sample, text) for each piece of `text`: the sample, counted from the stream's start, where the
    # audio of the first frame generated after the TTS was given that text begins (captions.py);
    # it may lie past this chunk's samples (a streamed chunk holds back the crossfade tail)
    marks: tuple[tuple[int, str], ...] = ()
    ends_segment: bool = False  # the last chunk of its segment (the final chunk too)


@dataclass(frozen=True)
class Utterance:
    codes: Tensor  # (T, num_vq) audio codes, on the CPU
    audio: np.ndarray  # float32 mono samples at `sample_rate`
    sample_rate: int = SAMPLE_RATE
    marks: tuple[tuple[int, str], ...] = ()  # the chunks' marks (AudioChunk.marks)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError("--device cuda: no CUDA device is available (use --device cpu)")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise DeviceError(f"unknown device '{device}' (use auto, cuda or cpu)") from None
    if dev.type == "cuda" and dev.index is not None and dev.index >= (count := torch.cuda.device_count()):
        raise DeviceError(f"--device {device}: this machine has {count} CUDA device{'s' * (count != 1)} "
                          f"(cuda:0 to cuda:{count - 1})")
    return dev


def free_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on `device` (a CPU: MemAvailable), None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_room(needed: int, device: torch.device) -> None:
    """A model of `needed` bytes fits what `device` has free, or a one-line DeviceError saying so."""
    free = free_memory(device)
    if free is not None and needed > free:
        where = "GPU memory" if device.type == "cuda" else "memory"
        raise DeviceError(f"the model needs about {needed / 2**30:.1f} GiB of {where} and {free / 2**30:.1f} GiB are "
                          f"free on {device}: free some, or use a smaller backend (--backend int4 on a GPU)")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
    if dtype not in table:
        raise DeviceError(f"unknown dtype '{dtype}' (use auto, bfloat16 or float32)")
    return table[dtype]


def build_tts(ckpt: Checkpoint, config: dict, *, device, dtype) -> ChatTTS:
    if "tts_config" not in config:
        raise CheckpointError(f"{ckpt.root / 'config.json'} has no tts_config: not a MiniCPM-o checkpoint")
    with torch.device("meta"):
        model = ChatTTS(TTSConfig.from_hf(config["tts_config"]))
    c = model.config
    heads = [
        fold_weight_norm(
            ckpt.tensor(f"tts.head_code.{q}.parametrizations.weight.original0", torch.float32, "cpu"),
            ckpt.tensor(f"tts.head_code.{q}.parametrizations.weight.original1", torch.float32, "cpu"),
        )
        for q in range(c.num_vq)
    ]
    expected = (c.num_audio_tokens, c.decoder.dim)
    for q, w in enumerate(heads):
        if tuple(w.shape) != expected:
            raise CheckpointError(
                f"tensor tts.head_code.{q}.parametrizations.weight.original1 has shape {list(w.shape)}, "
                f"expected {list(expected)}")
    load_module(model, ckpt, "tts.", dtype, device, derived={"heads": torch.stack(heads).to(device, dtype)})
    return model.eval()


def read_vocos(root: Path) -> dict[str, Tensor]:
    path = root / "assets" / "Vocos.pt"
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise CheckpointError(f"vocoder weights missing: {path}") from None
    except Exception as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def build_codec(ckpt: Checkpoint, vocos: dict[str, Tensor], *, device) -> Codec:
    dvae = ckpt.state_dict("tts.dvae.", torch.float32, skip=("encoder.", "downsample_conv."))
    try:
        return Codec.from_tensors(dvae, vocos, device)
    except (KeyError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"DVAE/Vocos weights do not fit: {e}") from None


def _codec_first_run(codec: Codec) -> threading.Thread:
    """The codec's first run, on a thread of its own and a stream of its own while the LLM loads: the
    libraries it calls set up (cuBLAS, cuFFT, cuDNN) and its kernels' modules loaded, as CUDA loads
    them at their first launch: the first request's codec warm-up 0.34 -> 0.17 s (H100); nothing it
    computes is kept. Started before the codec is wrapped (its eager decode)."""
    decode, built = codec.decode_batch, torch.cuda.Event()
    built.record(torch.cuda.current_stream(codec.device))  # (the codec's weights copied and cast)

    def run() -> None:
        try:
            stream = torch.cuda.Stream(codec.device)
            stream.wait_event(built)
            with trace.span("codec_first_run"), torch.cuda.stream(stream):
                codes = torch.zeros(1, FRAMES_PER_CALL, codec.num_vq, dtype=torch.long, device=codec.device)
                decode(codes)
                torch.cuda.current_stream().synchronize()
        except Exception:  # (a head start only: the first request meets any real problem itself)
            pass

    thread = threading.Thread(target=run, daemon=True, name="minicpm-codec-first-run")
    thread.start()
    return thread


def load_voices(model: str, tokenizers: Tokenizers, *, device, dtype) -> VoiceEncoder:
    """The audio encoder of `model` (a directory, or a hub repo whose shards holding it are fetched now)."""
    root = resolve(model, AUDIO_PREFIXES)
    return load_voice_encoder(Checkpoint(root), read_config(root), tokenizers, device=device, dtype=dtype,
                              features=FeatureConfig.from_dir(root))


class Synthesizer:
    """A loaded speech path. Not thread-safe: one utterance at a time."""

    sample_rate = SAMPLE_RATE

    def __init__(self, tokenizers: Tokenizers, llm: backends.LLMStage, tts: ChatTTS, codec: Codec,
                 tts_runner: TTSRunner | None = None, voices: Callable[[], VoiceEncoder] | None = None):
        """`voices` builds the audio encoder when a voice is first used (None: voices unavailable)."""
        self.tokenizers, self.llm, self.tts_model, self.codec = tokenizers, llm, tts, codec
        self.tts = tts_runner or TTSRunner(tts)
        self.device = tts.emb_text.weight.device
        self.llm_context = LLM_CONTEXT
        self._load_voices, self._voices = voices, None
        self._warm_rows = 1  # batches of up to this many rows have their graphs (warm_batches)
        # (voice digest, mode) -> the LLM context of the voice's turn (a backend's saved prefix),
        # least recently used first, at most PREFIX_BYTES in all
        self._prefixes: OrderedDict[tuple[str, str], object] = OrderedDict()

    @classmethod
    def load(cls, model: str | None = DEFAULT_MODEL, *, backend: str = "auto", device: str = "auto",
             dtype: str = "auto", random_weights: bool = False, seed: int = 0,
             spec=None, gguf: str | None = None, rows: int = 1, batch_invariant: bool = True) -> "Synthesizer":
        """From a checkpoint (directory or hub repo id), or with `random_weights` the full-size model
        drawn directly on the device (for speed work; tokenizers from `model` if it is a directory,
        else the bundled ones of the tiny test checkpoint; the audio encoder is drawn at the first
        voice). `backend="auto"` picks one for the device and checkpoint (`backends.choose`). `rows`:
        how many streams can be generated at once (`batch()`; each has its own rows of the KV caches;
        gguf runs one LLM stream). `batch_invariant`: a stream's audio is the same alone and in any
        batch, on the GPU too (compile and int4: backends/invariant.py); False takes the faster
        kernels whose rounding depends on the batch."""
        if rows < 1:
            raise UsageError("the batch size must be at least 1")
        dev = resolve_device(device)
        memory.apply_cap(dev)  # (MINICPM_MEMORY_CAP: this process as on a smaller GPU)
        if backend == backends.AUTO:
            backend = backends.choose(model, dev.type, gguf=gguf, free=memory.available(dev), dtype=dtype)
        be = backends.get(backend)
        be.check()
        dt = resolve_dtype(dtype, dev)
        if random_weights:
            from .synthetic import RandomCheckpoint, SyntheticSpec, parameter_count

            spec = spec or SyntheticSpec.full()
            if backend in ("eager", "compile"):  # (int4 and gguf hold their LLM in fewer bytes)
                check_room(parameter_count(spec, include_unused=False) * dt.itemsize, dev)
            ckpt = RandomCheckpoint(spec, seed=seed)
            config, vocos = ckpt.config, ckpt.vocos_state()
            tokenizers = Tokenizers(Path(model) if model and Path(model).is_dir() else BUNDLED_TOKENIZERS)
            voices = functools.partial(load_voice_encoder, ckpt, config, tokenizers, device=dev, dtype=dt)
        else:
            root = resolve(model or DEFAULT_MODEL, be.prefixes)
            config, ckpt = read_config(root), Checkpoint(root)
            with trace.span("load_tokenizers"):
                tokenizers = Tokenizers(root)
            with trace.span("load_vocos"):
                vocos = read_vocos(root)
            voices = functools.partial(load_voices, model or DEFAULT_MODEL, tokenizers, device=dev, dtype=dt)
        if dev.type == "cuda":
            with trace.span("cuda_init"):
                torch.cuda.init()
                torch.empty(1, device=dev)
            if dt == torch.float32:
                # float32 asked for is float32 arithmetic: cuDNN's convolutions (the codec's) take
                # TF32 by torch's default (its matmuls do not): the tiny fixture's 'digits' read
                # 7.5e-5 from its golden with TF32, 1.1e-7 without (H100)
                torch.backends.cudnn.allow_tf32 = False
        with trace.span("load_tts"):
            tts = build_tts(ckpt, config, device=dev, dtype=dt)
        with trace.span("load_codec"):
            codec = build_codec(ckpt, vocos, device=dev)
            first_run = _codec_first_run(codec) if dev.type == "cuda" else None
            be.wrap_codec(codec, invariant=batch_invariant)
        try:
            with trace.span("load_llm"):
                llm = be.create(ckpt, config, device=dev, dtype=dt, max_len=LLM_CONTEXT, gguf=gguf,
                                rows=rows if rows > 1 else None, invariant=batch_invariant)
        finally:
            if first_run is not None:  # (before anything captures a CUDA graph: a capture bars other threads'
                with trace.span("codec_first_run_wait"):  # work; and not left running where loading failed)
                    first_run.join()
        with trace.span("load_tts_runner"):
            runner = be.tts_runner(tts, rows, invariant=batch_invariant)
        return cls(tokenizers, llm, tts, codec, runner, voices)

    @property
    def voices(self) -> VoiceEncoder:
        """The audio encoder, built on first use."""
        if self._voices is None:
            if self._load_voices is None:
                raise UsageError("voices need the checkpoint's audio encoder; this synthesizer was built "
                                 "without one")
            self._voices = self._load_voices()
        return self._voices

    def voice_context(self, llm, voice: Voice, mode: str) -> int:
        """Start `llm` (the stage or a lane of it) on `voice`'s turn in `mode` -> the turn's length in
        tokens: its KV cache put back when kept (nothing encoded), else the turn encoded, prefilled and
        its cache kept. Either way the turn is its own forward, so what follows it gives the same
        result whether the turn was computed now or before."""
        key = (voice.digest, mode)
        prefix = self._prefixes.get(key)
        if prefix is not None:
            self._prefixes.move_to_end(key)
            llm.load_prefix(prefix)
            return prefix.length
        turn = self.voices.turn(voice, mode)
        llm.reset()
        llm.forward(turn.ids, turn.embeds, turn.embed_at)
        self._prefixes[key] = llm.save_prefix()
        while len(self._prefixes) > 1 and sum(p.nbytes for p in self._prefixes.values()) > PREFIX_BYTES:
            self._prefixes.popitem(last=False)
        return len(turn.ids)

    def forget_voices(self) -> None:
        """Drop every voice's kept encodings and contexts (the next use computes them anew)."""
        self._prefixes.clear()
        if self._voices is not None:
            self._voices.clear()

    @property
    def rows(self) -> int:
        """How many streams can be generated at once (the rows of the TTS and LLM caches)."""
        return min(self.tts.rows, getattr(self.llm, "rows", 1))

    def batch(self, rows: int | None = None):
        """An engine that generates up to `rows` streams at once (default: as many as loaded)."""
        from .batching import Engine

        engine = Engine(self, rows)
        self.warm_batches(engine.rows)
        return engine

    def warm_batches(self, rows: int) -> None:
        """Capture, once, the CUDA graphs of batches of up to `rows` streams that a batch would
        otherwise capture mid-run, stalling every stream (the TTS runner's, the LLM stage's and the
        codec's `warm_batches`, where a backend gives them). A second call for as many rows or fewer
        does nothing."""
        if rows <= self._warm_rows:
            return
        for name, stage in (("tts", self.tts), ("llm", self.llm), ("codec", self.codec)):
            warm = getattr(stage, "warm_batches", None)
            if warm is not None:
                with trace.span("warm_batches", stage=name, rows=rows):
                    warm(rows)
        self._warm_rows = rows

    def say_many(self, items: Iterable[tuple[str, Sampling]], *, batch: int = 1, voice=None,
                 decode: str = "segment", frames_per_token: int | None = None,
                 speed: float = 1.0) -> Iterator[list[AudioChunk]]:
        """Read many texts, up to `batch` at a time in one batch of streams; each text's chunks (as
        `synthesize` gives them) in input order. `batch=1` reads them one after another."""
        from .batching import in_order

        voice = as_voice(voice)
        jobs = (self.read_job(text, sampling, voice=voice, decode=decode, frames_per_token=frames_per_token,
                              speed=speed)
                for text, sampling in items)
        if batch == 1:
            for job in jobs:
                yield list(job.make(None))
            return
        yield from in_order(self.batch(batch), jobs, batch)

    def say_batch(self, requests: list[tuple[str, Sampling, Voice | np.ndarray | None]], *,
                  speed: float = 1.0, frames_per_token: int | None = None) -> list[Utterance]:
        """`say` for each (text, sampling, voice), generated together, up to `rows` at a time; in order.
        `frames_per_token`: lengths forced (random weights), as `say_many` forces them."""
        from .batching import in_order

        if self.rows == 1 or len(requests) == 1:
            return [self.say(text, sampling, voice=voice, speed=speed, frames_per_token=frames_per_token)
                    for text, sampling, voice in requests]
        jobs = (self.read_job(text, sampling, voice=as_voice(voice), speed=speed, frames_per_token=frames_per_token)
                for text, sampling, voice in requests)
        return [self._utterance(chunks) for chunks in in_order(self.batch(), jobs, self.rows)]

    @staticmethod
    def _utterance(chunks: list[AudioChunk]) -> Utterance:
        return Utterance(codes=torch.cat([c.codes for c in chunks]), audio=np.concatenate([c.samples for c in chunks]),
                         marks=tuple(m for c in chunks for m in c.marks))

    def read_job(self, text: str, sampling: Sampling, *, voice=None, decode: str = "segment",
                 frames_per_token: int | None = None, first_chunk: int = FRAMES_PER_CALL, speed: float = 1.0) -> Job:
        """`synthesize(text, ...)` as a job of a batch (`batching.in_order`), sized by the text's TTS
        tokens (the audio's length grows with them)."""
        from .batching import Job

        def make(lane):
            return self.synthesize(text, sampling, decode=decode, first_chunk=first_chunk,
                                   frames_per_token=frames_per_token, voice=voice, lane=lane, speed=speed)

        return Job(make, len(self.tokenizers.encode_bert(text)))

    def speaker(self, prompt_ids: list[int], llm=None, reset: bool = True, tts=None) -> Tensor:
        """Run the LLM (`llm`: a lane of it; default the single stream) over a prompt, from an empty
        context (`reset`) or after what it holds (a voice's turn); the projected hidden state at the
        prompt's last <|spk|> (hidden,), by `tts` (a lane of the TTS runner, whose batch projects
        its streams' together; default the single stream)."""
        llm = llm or self.llm
        if reset:
            llm.reset()
        _, hidden = llm.forward(prompt_ids)
        return self._project(hidden[len(prompt_ids) - 1 - prompt_ids[::-1].index(self.tokenizers.spk_id)], tts)

    def _project(self, hidden: Tensor, tts=None) -> Tensor:
        return (tts or self.tts).speaker(hidden)

    def read_prompt_ids(self, text: str, reserved: int = 0) -> list[int]:
        """The read-aloud prompt, in `llm_context - reserved` tokens; a text longer than that keeps its
        beginning (the speaker vector only needs the hidden state at <|spk|>, and one vector serves
        every segment)."""
        tok = self.tokenizers
        ids = tok.encode_llm(read_prompt(text))
        context = self.llm_context - reserved
        if len(ids) <= context:
            return ids
        text_ids = tok.encode_llm(text)
        room = context - (len(ids) - len(text_ids)) - 8  # 8: re-tokenisation at the cut
        return tok.encode_llm(read_prompt(tok.llm.decode(text_ids[:room])))

    def _read_speaker(self, text: str, voice: Voice | None, lane=None) -> Tensor:
        """The speaker vector of a read: the reference's chat() read prompt, after its voice-cloning
        turn when there is a voice (spec §4.3; the turn's context kept per voice); on `lane`'s rows
        of a batch if given."""
        llm, tts = (lane.llm, lane.tts) if lane else (self.llm, None)
        if voice is None:
            return self.speaker(self.read_prompt_ids(text), llm=llm, tts=tts)
        turn = self.voice_context(llm, voice, "read")
        return self.speaker(self.read_prompt_ids(text, reserved=turn), llm=llm, reset=False, tts=tts)

    def synthesize(self, text: str, sampling: Sampling = Sampling(), *, decode: str = "stream",
                   first_chunk: int = FRAMES_PER_CALL, frames_per_token: int | None = None,
                   voice: Voice | np.ndarray | None = None, lane=None, speed: float = 1.0) -> Iterator[AudioChunk]:
        """Read `text` aloud (spec §4.3: the caller's text, not an LLM rewrite), as audio chunks, in
        the model's default voice or in a cloned `voice` (16 kHz mono float32 samples or a Voice).
        `lane`: the rows of a batch (`batching.Lane`) it runs on; default the single stream.

        decode="stream": each generation call is decoded as soon as it exists, with the reference's
        4-frame context and crossfade, and released at once (`first_chunk` frames first).
        decode="segment": each segment is decoded in one call when complete: for text that fits one
        segment (< 300 TTS tokens) this is exactly the reference's read-aloud waveform.
        Text longer than one segment is cut at sentence ends into segments that continue each other
        as the reference's streaming path does (spec §4.5 step 7); nothing is dropped.
        `speed`: the tempo (0.25-4), the pitch kept (the module's docstring).
        """
        check_speed(speed)
        text = unicode_text(text, "the text").strip()
        if not text:
            raise UsageError("no text to speak")
        tok = self.tokenizers
        if not tok.encode_bert(text):
            raise UsageError("the text has nothing the TTS tokenizer can read")
        spk = self._read_speaker(text, as_voice(voice), lane)
        pieces = read_pieces(text, lambda t: len(tok.encode_bert(t)))
        machine = StreamingTTS(lane.tts if lane else self.tts, tok, spk, sampling.generator(self.device), normalize=False,
                               cut=read_cut, read_all=True, first_chunk=first_chunk,
                               frames_per_token=frames_per_token)
        events = machine.run("", iter(pieces))
        yield from self._audio(events, decode, lane, speed)

    def synthesize_arriving(self, arrivals: Iterable[tuple[str, bool] | Arrival], sampling: Sampling = Sampling(), *,
                            decode: str = "stream", first_chunk: int = FRAMES_PER_CALL,
                            frames_per_token: int | None = None, voice: Voice | np.ndarray | None = None,
                            speed: float = 1.0, lane=None) -> Iterator[AudioChunk]:
        """Read text that is still arriving: `arrivals` gives (text, ended) as it comes (each item all
        that could be read at once, and whether the input ended right after it; an `Arrival` may also
        ask for a flush). Speech starts on the first part ready by `text.ready_parts` (a sentence, a
        clause long enough, a long run cut at a word, or all that is pending at a flush). A part comes
        as its writer pauses, so its segment is spoken to its EOS then (`streaming.FLUSH`; its last
        chunk goes out at once, `ends_segment`) and the next part continues it as a long text's next
        segment (the same speaker vector, seeded with the last frames); it ends when the input does.
        The speaker vector comes from the first part's read prompt. A text that arrives whole (ended
        with its first part) is exactly `synthesize(text)`."""
        check_speed(speed)
        tok = self.tokenizers
        count = lambda t: len(tok.encode_bert(t))  # noqa: E731
        parts = ready_parts(((unicode_text(a[0], "the text"), *a[1:]) for a in arrivals), count)
        first, last = next(parts)
        while not last and not tok.encode_bert(first):  # (nothing the TTS reads yet: "..." alone)
            more, last = next(parts)
            first += more
        first = first.lstrip()
        if last:
            yield from self.synthesize(first, sampling, decode=decode, first_chunk=first_chunk,
                                       frames_per_token=frames_per_token, voice=voice, speed=speed, lane=lane)
            return
        spk = self._read_speaker(first.strip(), as_voice(voice), lane)

        def pieces() -> Iterator[str]:
            # (each part came as its writer paused: what is there is spoken to its end now, and what
            # follows continues it as the next segment)
            yield from read_pieces(first, count)
            yield FLUSH
            for part, last in parts:
                if part.strip():
                    yield from read_pieces(part, count)
                if not last:
                    yield FLUSH

        machine = StreamingTTS(lane.tts if lane else self.tts, tok, spk, sampling.generator(self.device),
                               normalize=False, cut=read_cut, read_all=True, first_chunk=first_chunk,
                               frames_per_token=frames_per_token)
        yield from self._audio(machine.run("", pieces()), decode, lane, speed)

    def reply(self, user_text: str, sampling: Sampling = Sampling(), *, llm: LLMSampling = LLMSampling(),
              max_tokens: int = 512, first_chunk: int = FRAMES_PER_CALL, frames_per_token: int | None = None,
              voice: Voice | np.ndarray | None = None, lane=None, speed: float = 1.0) -> Iterator[AudioChunk]:
        """The spoken answer to a user message (spec §4.5), streamed: LLM text pieces feed the TTS as
        they are generated; each chunk carries the reply text it speaks. With a `voice`, the
        reference's audio-assistant system turn comes first and the answer is spoken in that voice."""
        check_speed(speed)
        if not unicode_text(user_text, "the text").strip():
            raise UsageError("no text to reply to")
        if max_tokens < 1:
            raise UsageError("--max-tokens must be at least 1")
        voice = as_voice(voice)
        stage = lane.llm if lane else self.llm
        start = None if voice is None else functools.partial(self.voice_context, stage, voice, "reply")
        generator = sampling.generator(self.device)
        pieces = reply_pieces(stage, self.tokenizers, user_text, llm, generator, max_tokens,
                              force_length=frames_per_token is not None, voice=start)
        first = next(pieces)
        spk = self._project(first.spk_hidden, lane and lane.tts)
        machine = StreamingTTS(lane.tts if lane else self.tts, self.tokenizers, spk, generator, normalize=True, cut=reply_cut,
                               first_chunk=first_chunk, frames_per_token=frames_per_token)
        yield from self._audio(machine.run(first.text, (p.text for p in pieces)), "stream", lane, speed)

    def _audio(self, events: Iterator[Frames | SegmentEnd | NewSegment], decode: str, lane=None,
               speed: float = 1.0) -> Iterator[AudioChunk]:
        """The events' frames decoded into chunks. Each event's text is marked at the first sample of
        its first frame: a segment's frame j begins `samples_at(lead + j)` after the segment's first
        sample (j * samples_per_frame at speed 1), where lead is the context a streamed continuation
        decodes (and plays) again. A segment's last chunk comes at its SegmentEnd when it has one (a
        FLUSH ended it: its audio goes out before the machine waits for more text), else when the
        next segment starts or the events end."""
        if decode not in ("stream", "segment"):
            raise UsageError(f"unknown decode mode '{decode}' (stream or segment)")
        codec = lane.codec if lane else self.codec  # (a batch's lane: its decodes batched with others')
        text, codes, segment, marks = "", [], 0, []
        dec = StreamDecoder(codec, hold_first=False, speed=speed) if decode == "stream" else None
        context = None  # segment mode: frames a continuation carried over
        made = start = lead = frames = 0  # samples yielded; the segment's first sample, lead, new frames
        ended = False  # the segment's last chunk has gone out (at its SegmentEnd)

        def rest() -> Tensor:  # the segment's audio not yet yielded
            return dec.flush() if dec else self._decode_segment(codec, context, codes, speed)

        for ev in events:
            if isinstance(ev, SegmentEnd | NewSegment) and not ended:
                audio = rest()
                yield from self._chunk(audio, text, codes, segment, marks=marks, ends_segment=True)
                made += len(audio)
                text, codes, marks, ended = "", [], [], True
            if isinstance(ev, SegmentEnd):
                continue
            if isinstance(ev, NewSegment):
                segment, context, ended = segment + 1, ev.carried, False
                start, frames = made, 0
                if dec:
                    dec.reset(ev.carried)
                    lead = min(len(ev.carried), dec.context_frames)
                continue
            if ev.text:
                marks.append((start + samples_at(codec, lead + frames, speed), ev.text))
            frames += len(ev.codes)
            text += ev.text
            codes.append(ev.codes)
            if dec:
                out = dec.feed(ev.codes)
                if out is not None:
                    yield from self._chunk(out, text, codes, segment, marks=marks)
                    made += len(out)
                    text, codes, marks = "", [], []
        audio = torch.zeros(0) if ended else rest()
        yield from self._chunk(audio, text, codes, segment, final=True, marks=marks, ends_segment=True)

    def _decode_segment(self, codec, context: Tensor | None, frames: list[Tensor], speed: float = 1.0) -> Tensor:
        """One-call decode; a continuation is decoded after the frames it carried over (already heard),
        whose audio is then dropped, so the segment starts with full left context."""
        codes = torch.cat(frames) if frames else torch.zeros(0, codec.num_vq, dtype=torch.long)
        if context is None:
            return codec.decode_at(codes, speed)  # (speed 1: `decode` itself)
        wav = codec.decode_at(torch.cat([context.to(codes.device), codes]), speed)
        return wav[samples_at(codec, len(context), speed) :]

    def _chunk(self, audio: Tensor, text: str, codes: list[Tensor], segment: int, final: bool = False,
               marks: list[tuple[int, str]] = (), ends_segment: bool = False) -> Iterator[AudioChunk]:
        if len(audio) or text or codes or final or ends_segment:
            frames = torch.cat(codes).cpu() if codes else torch.zeros(0, self.codec.num_vq, dtype=torch.long)
            yield AudioChunk(audio.float().cpu().numpy(), self.sample_rate, text, frames, segment, final,
                             tuple(marks), ends_segment)

    def say(self, text: str, sampling: Sampling = Sampling(), *, voice: Voice | np.ndarray | None = None,
            speed: float = 1.0, frames_per_token: int | None = None) -> Utterance:
        """The whole read-aloud utterance at once (decoded per segment, as the reference reads).
        `frames_per_token`: lengths forced (random weights)."""
        return self._utterance(list(self.synthesize(text, sampling, decode="segment", voice=voice, speed=speed,
                                                    frames_per_token=frames_per_token)))


def check_speed(speed: float) -> None:
    """A speed in protocol.SPEED_RANGE, or a one-line UsageError (NaN included)."""
    low, high = protocol.SPEED_RANGE
    if not low <= speed <= high:
        raise UsageError(f"speed must be between {low:g} and {high:g}, not {speed:g}")
