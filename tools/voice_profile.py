"""Where a read's first audio spends its time with a voice: new, kept, and without one.

Loads the full-size model with random weights (or `--model DIR`), then times, each after a device
sync, the steps a read takes before its TTS starts:

- new voice: reading the file, encoding it (features, encoder, projection, pooling, the turn's ids),
  the turn's LLM prefill (and the copy of its KV cache kept), then the read prompt's prefill after it;
- kept voice: putting the turn's KV cache back, then the read prompt's prefill;
- no voice: the read prompt's prefill from an empty context.

Medians over `--runs` after one untimed pass, as Markdown on stdout.

    python tools/voice_profile.py --voice ref10.wav
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minicpm_cli.cli.bench import READ_TEXTS
from minicpm_cli.engine.pipeline import Synthesizer
from minicpm_cli.voices.reference import Voice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--voice", required=True, help="a reference recording")
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: random weights)")
    ap.add_argument("--backend", default="compile")
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    synth = Synthesizer.load(args.model, backend=args.backend, random_weights=args.model is None)
    dev = synth.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    llm, text = synth.llm, READ_TEXTS[0]
    times: dict[str, list[float]] = {}

    def timed(name: str, fn):
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        times.setdefault(name, []).append((time.perf_counter() - t) * 1e3)
        return out

    for run in range(args.runs + 1):
        if run == 1:
            times.clear()  # the first pass compiles and captures
        synth.forget_voices()
        voice = timed("new: read the file", lambda: Voice.load(args.voice))
        turn = timed("new: encode (features, encoder, turn ids)", lambda: synth.voices.turn(voice, "read"))
        timed("new: the turn's LLM prefill + its KV copy kept", lambda: synth.voice_context(llm, voice, "read"))
        ids = synth.read_prompt_ids(text, reserved=len(turn.ids))
        timed("new: read prompt prefill after the turn", lambda: llm.forward(ids))
        timed("kept: KV cache put back", lambda: synth.voice_context(llm, voice, "read"))
        timed("kept: read prompt prefill after the turn", lambda: llm.forward(ids))
        plain = synth.read_prompt_ids(text)
        timed("none: reset", llm.reset)
        timed("none: read prompt prefill", lambda: llm.forward(plain))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"{name}, backend {args.backend}, voice {args.voice} ({voice.seconds:.2f} s, turn {len(turn.ids)} "
          f"tokens), read prompt {len(plain)} tokens; median (min-max) of {args.runs} runs, ms\n")
    print("| step | ms |\n|---|---|")
    for k, xs in times.items():
        print(f"| {k} | {statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f}) |")


if __name__ == "__main__":
    main()
