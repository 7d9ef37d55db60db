"""Requests alone and in batches, their codes and samples compared for equality (GPU, full-size random weights).

    python tools/batch_parity.py [--backend compile] [--streams 16] [--sizes 2 3 16] [--variant]
                                 [--voice REF.wav] [--model DIR] [--device auto] [--dtype auto]
                                 [--sampling greedy seeded] [--json FILE]

The benchmark's read and reply requests (cycled to --streams), each greedy and seeded (its own seed),
lengths forced as `bench --random-weights` forces them, run alone (the single-stream path), then:
batches of each --sizes (the requests dealt in a shuffled order, so each lands on other rows), all of
them at once, and a mid-flight join (half started, the rest submitted once the first have played a
call). Prints, per configuration and sampling, how many requests gave exactly the same codes (and a
reply's text) and exactly the same samples as alone. `--variant` loads the batch-variant kernels;
`--voice` has every other request speak in the voice of that recording (with random weights the
audio encoder is drawn too; with --model, a checkpoint with the audio encoder).
"""

from __future__ import annotations

import argparse
import json
import random

import numpy as np
import torch

from minicpm_cli.cli import bench as b
from minicpm_cli.engine.batching import Stream
from minicpm_cli.engine.pipeline import Synthesizer
from minicpm_cli.voices.reference import Voice


FORCED = b.BenchOptions(random_weights=True)  # the bench's requests, lengths forced


def request(synth, kind: str, text: str, seed: int | None, voice=None, lane=None):
    """The bench's request (`bench.request_stream`; seed None: greedy)."""
    return b.request_stream(synth, kind, text, seed, FORCED, lane=lane, voice=voice)


def result(chunks) -> tuple[torch.Tensor, str, np.ndarray]:
    return (torch.cat([c.codes for c in chunks]), "".join(c.text for c in chunks),
            np.concatenate([c.samples for c in chunks]))


def together(synth, engine, reqs, order, join_after: int | None = None) -> dict:
    """Run reqs[k] for k in `order` on the engine (submitted in that order); with `join_after`, the
    second half is submitted after that many engine rounds -> {k: result}."""
    got = {k: [] for k in order}
    first = order if join_after is None else order[: len(order) // 2]
    for k in first:
        engine.submit(Stream(lambda lane, k=k: request(synth, *reqs[k], lane=lane), got[k].append))
    if join_after is not None:
        for _ in range(join_after):
            engine.round()
        for k in order[len(order) // 2:]:
            engine.submit(Stream(lambda lane, k=k: request(synth, *reqs[k], lane=lane), got[k].append))
    engine.run()
    return {k: result(v) for k, v in got.items()}


def compare(alone, got, kinds=None) -> tuple[int, int, list[str]]:
    """-> (requests with equal codes and text, with equal samples, what differs in the others)"""
    codes = samples = 0
    notes = []
    for k, (c, t, s) in sorted(got.items()):
        ca, ta, sa = alone[k]
        same_codes = len(c) == len(ca) and bool(torch.equal(c, ca)) and t == ta
        codes += same_codes
        samples += s.shape == sa.shape and bool(np.array_equal(s, sa))
        if not same_codes:
            n = min(len(c), len(ca))
            diff = (c[:n] != ca[:n]).any(1).nonzero()
            first = int(diff[0]) if len(diff) else n
            notes.append(f"{k}:{kinds[k] if kinds else ''} frame {first}/{len(ca)}{' text' if t != ta else ''}")
        elif not np.array_equal(s, sa):
            notes.append(f"{k}: samples only")
    return codes, samples, notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="compile")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--sizes", type=int, nargs="*", default=[2, 3])
    ap.add_argument("--variant", action="store_true", help="the batch-variant kernels")
    ap.add_argument("--voice", default=None, help="a reference recording: every other request speaks in it")
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: random weights)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--sampling", nargs="+", choices=("greedy", "seeded"), default=["greedy", "seeded"])
    ap.add_argument("--json", default=None, help="write the table here too")
    args = ap.parse_args()
    kinds = [("read", t) for t in b.READ_TEXTS] + [("reply", t) for t in b.REPLY_PROMPTS]
    kinds = [kinds[k % len(kinds)] for k in range(args.streams)]
    synth = Synthesizer.load(args.model, backend=args.backend, random_weights=args.model is None, rows=args.streams,
                             device=args.device, dtype=args.dtype, batch_invariant=not args.variant)
    voice = Voice.load(args.voice) if args.voice else None
    engine = synth.batch()
    rng = random.Random(0)
    rows = []
    for mode in args.sampling:
        reqs = [(kind, text, None if mode == "greedy" else 100 + k, voice if k % 2 else None)
                for k, (kind, text) in enumerate(kinds)]
        alone = {k: result(list(request(synth, *r))) for k, r in enumerate(reqs)}
        again = {k: result(list(request(synth, *r))) for k, r in enumerate(reqs)}
        configs = [("alone, run again", again)]
        for size in args.sizes:
            got = {}
            order = list(range(len(reqs)))
            rng.shuffle(order)
            for i in range(0, len(order), size):
                got.update(together(synth, engine, reqs, order[i : i + size]))
            configs.append((f"batches of {size}, shuffled", got))
        order = list(range(len(reqs)))
        rng.shuffle(order)
        configs.append((f"one batch of {len(reqs)}, shuffled", together(synth, engine, reqs, order)))
        configs.append(("half joining mid-flight (after 40 rounds)", together(synth, engine, reqs, order, 40)))
        for name, got in configs:
            codes, samples, notes = compare(alone, got, [kind for kind, _ in kinds])
            rows.append({"sampling": mode, "configuration": name, "codes_equal": codes, "samples_equal": samples,
                         "requests": len(got)})
            print(f"{mode:6s} | {name:42s} | codes {codes}/{len(got)} | samples {samples}/{len(got)}"
                  + (f" | {'; '.join(notes)}" if notes else ""), flush=True)
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"({args.backend}, {'--variant' if args.variant else 'invariant by default'}, {synth.tts.dtype}, {dev}"
          f"{', every other request in a voice' if voice is not None else ''})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "variant": args.variant, "device": dev, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
