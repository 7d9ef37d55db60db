"""Greedy codes of the benchmark requests alone and in one batch, compared (GPU, full-size random weights).

    python tools/batch_parity.py [--backend compile] [--streams 16] [--model DIR]

Each read and reply request of `minicpm bench` runs alone (the single-stream path: on CUDA the Triton
decode kernels), then all of them together as one batch of streams (rows beyond one run cuBLAS
products in CUDA graphs). Greedy everywhere and lengths forced as `bench --random-weights` forces
them, so only the arithmetic differs. Prints, per request, whether its codes (and a reply's text
tokens) are equal and, where not, the first frame that differs and how many do.
"""

from __future__ import annotations

import argparse

import torch

from minicpm_cli.cli import bench as b
from minicpm_cli.engine import loading
from minicpm_cli.engine.batching import Stream
from minicpm_cli.engine.llm import LLMSampling
from minicpm_cli.engine.pipeline import Synthesizer
from minicpm_cli.engine.sampling import Sampling


def request(synth, kind: str, text: str, lane=None):
    forced = loading.FORCED_FRAMES_PER_TOKEN
    if kind == "read":
        return synth.synthesize(text, Sampling(greedy=True), frames_per_token=forced, lane=lane)
    return synth.reply(text, Sampling(greedy=True), llm=LLMSampling(temperature=b.REPLY_TEMPERATURE),
                       max_tokens=loading.FORCED_REPLY_TOKENS, frames_per_token=forced, lane=lane)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="compile")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: random weights)")
    ap.add_argument("--dtype", default="auto", help="float32: only the summation order differs")
    args = ap.parse_args()
    reqs = [("read", t) for t in b.READ_TEXTS] + [("reply", t) for t in b.REPLY_PROMPTS]
    reqs = [reqs[k % len(reqs)] for k in range(args.streams)]
    synth = Synthesizer.load(args.model, backend=args.backend, random_weights=args.model is None, rows=args.streams,
                            dtype=args.dtype)
    alone = []
    for kind, text in reqs:
        chunks = list(request(synth, kind, text))
        alone.append((torch.cat([c.codes for c in chunks]), "".join(c.text for c in chunks)))
    engine = synth.batch()
    together = [[] for _ in reqs]
    for k, (kind, text) in enumerate(reqs):
        engine.submit(Stream(lambda lane, kind=kind, text=text: request(synth, kind, text, lane), together[k].append))
    engine.run()
    same = 0
    for k, ((kind, text), (codes, said)) in enumerate(zip(reqs, alone)):
        got = torch.cat([c.codes for c in together[k]])
        got_text = "".join(c.text for c in together[k])
        n = min(len(got), len(codes))
        diff = (got[:n] != codes[:n]).any(1).nonzero()
        equal = len(got) == len(codes) and not len(diff) and got_text == said
        same += equal
        where = "" if equal else (f" first differing frame {int(diff[0])} of {len(codes)}, {len(diff)} differ"
                                  f"{', lengths ' + str((len(codes), len(got))) if len(got) != len(codes) else ''}"
                                  f"{', reply text differs' if got_text != said else ''}")
        print(f"{k:2d} {kind:5s} {'equal' if equal else 'DIFFERENT'}{where} | {text[:40]!r}")
    print(f"{same}/{len(reqs)} requests give the same greedy codes alone and in a batch of {args.streams} "
          f"({args.backend}, {synth.tts.dtype}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'})")


if __name__ == "__main__":
    main()
