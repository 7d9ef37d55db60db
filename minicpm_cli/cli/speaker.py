"""Who speaks for `say`, `reply` and `bulk`: the model loaded in this process (`Local`), or a running
`minicpm serve` (`serving.client.Remote`, found at MINICPM_SERVER, by default the address `serve`
uses). Both give chunks of float32 samples that the same sinks write (a server converts them for
stdout, --raw and 16-bit WAV, as the sink would). Through a server nothing imports torch.

`--voice REF` is resolved before any model is looked for (`voices.store.resolve`: an existing file,
`default`, else a saved voice).
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from .. import trace
from ..errors import OptionError
from .options import SpeakerOptions, check_model_options


def load_here(model: Optional[str], backend: str, device: str, dtype: str, gguf: Optional[str] = None,
              verbose: bool = False, rows: Optional[int] = 1, batch_variant: bool = False,
              random_weights: bool = False, most_rows: Optional[int] = None):
    """The model loaded in this process (a Synthesizer), `rows` streams at once (None: as many as the
    GPU's free memory holds, at most `most_rows`; `batch_variant`: the faster kernels whose rounding
    depends on the batch; `random_weights`: the full-size model drawn on the device, for speed work)."""
    from ..engine import loading

    trace.mark("imported")
    synth, backend, model = loading.load(model, backend, device, dtype, gguf, rows=rows, most_rows=most_rows,
                                         batch_invariant=not batch_variant, random_weights=random_weights)
    trace.mark("loaded")
    if verbose:
        print(f"minicpm: backend {backend}, device {synth.device}, model {model}", file=sys.stderr)
    return synth


class Local:
    """The model in this process, behind the interface `client.Remote` offers `say` and `reply` (float
    samples always: `pcm`, the format a raw sink writes, is for a server to convert to; the chunks
    always carry the marks captions are timed by, so `timestamps` asks nothing more here)."""

    def __init__(self, synth):
        self.synth, self.sample_rate = synth, synth.sample_rate
        self.voice = None  # --voice: every request of this command speaks in it

    def take_voice(self, voice) -> None:
        self.voice = voice

    def read(self, text: str, *, greedy: bool, seed: Optional[int], decode: str, first_chunk: int,
             speed: float = 1.0, pcm: Optional[str] = None, timestamps: bool = False):
        from ..engine.sampling import Sampling

        return self.synth.synthesize(text, Sampling(greedy=greedy, seed=seed), decode=decode, first_chunk=first_chunk,
                                     voice=self.voice, speed=speed)

    def read_arriving(self, arrivals, *, greedy: bool, seed: Optional[int], decode: str, first_chunk: int,
                      speed: float = 1.0, pcm: Optional[str] = None, timestamps: bool = False):
        """`read` of text still arriving ((text, ended) items: `streams.arriving`), speech starting on
        its first part ready (`Synthesizer.synthesize_arriving`)."""
        from ..engine.sampling import Sampling

        return self.synth.synthesize_arriving(arrivals, Sampling(greedy=greedy, seed=seed), decode=decode,
                                              first_chunk=first_chunk, voice=self.voice, speed=speed)

    def read_many(self, texts, *, batch: int, greedy: bool, seed: Optional[int], decode: str, first_chunk: int,
                  speed: float = 1.0):
        """Each text's chunks (a list), in input order, `batch` of them generated at once."""
        from ..engine.batching import in_order
        from ..engine.sampling import Sampling

        sampling = Sampling(greedy=greedy, seed=seed)
        jobs = (self.synth.read_job(t, sampling, voice=self.voice, decode=decode, first_chunk=first_chunk, speed=speed)
                for t in texts)
        return in_order(self.synth.batch(batch), jobs, batch)

    def reply(self, message: str, *, greedy: bool, seed: Optional[int], temperature: float, max_tokens: int,
              first_chunk: int, speed: float = 1.0, pcm: Optional[str] = None, timestamps: bool = False):
        from ..engine.llm import LLMSampling
        from ..engine.sampling import Sampling

        return self.synth.reply(message, Sampling(greedy=greedy, seed=seed), llm=LLMSampling(temperature=temperature),
                                max_tokens=max_tokens, first_chunk=first_chunk, voice=self.voice, speed=speed)


def resolve_voice(ref: Optional[str]):
    """The voice --voice names (a file or a saved voice), read and checked before any model is looked
    for (no torch); None for the model's own."""
    if ref is None:
        return None
    from ..voices.store import resolve

    return resolve(ref)


def speaker(opts: SpeakerOptions, rows: int = 1):
    """A running server when one answers (--server URL, else $MINICPM_SERVER or the default address),
    unless --local; otherwise the model loaded here. What the server cannot honour is an error.
    The speaker speaks in --voice's voice: the model here takes it, a server gets its samples with
    every request."""
    if opts.local and opts.server is not None:
        raise OptionError("--local and --server do not go together")
    check_model_options(opts.backend, opts.device, opts.dtype, opts.gguf)  # (the same errors either way)
    voice = resolve_voice(opts.voice)
    chosen = None
    if not opts.local:
        from ..serving.client import Remote, server_url

        remote = Remote.find(*server_url(opts.server))
        if remote is not None:
            # no model in this process: numpy, where a sink needs it, needs none of OpenBLAS's threads
            # (one a core), whose start took 25-70 ms of numpy's import on the 2-core machine
            os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
            remote.check(model=opts.model, backend=opts.backend, device=opts.device, dtype=opts.dtype, gguf=opts.gguf)
            if opts.batch_variant:
                raise OptionError("--batch-variant chooses the kernels of a model loaded here; the server chose its "
                                  "own when it started (minicpm serve --batch-variant): add --local")
            if opts.verbose:
                print(f"minicpm: {remote.describe()}", file=sys.stderr)
            chosen = remote
    if chosen is None:
        chosen = Local(load_here(opts.model, opts.backend, opts.device, opts.dtype, opts.gguf, opts.verbose, rows,
                                 opts.batch_variant))
    if voice is not None:
        chosen.take_voice(voice)
    return chosen
