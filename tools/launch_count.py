"""How many device operations a batch of streams launches, stage by stage, without a GPU.

    python tools/launch_count.py [--streams 128] [--workload reply|read] [--rounds]

N requests of the bench's workload start together on the tiny random model (the bench's forced
lengths) on the CPU with the eager backend; after a warm-up batch, a second batch runs under a torch
dispatch mode that counts every aten operation that computes something (views and no-op
conversions left out), each charged to the engine stage running it: the round's batched LLM prompts,
token choices, TTS segment starts, text prefills, codec decodes, LLM token and TTS steps, and
"stream" for what each stream runs on its own between them. On a GPU each counted operation is a
kernel launch or more (a few microseconds of host time each, on the host's critical path wherever the
GPU waits for a round's streams); the stages that replay CUDA graphs there (the steps, prefills and
the codec) are counted as their eager code and are not what this is for. The CPU decodes each stream
alone; here the codec is batched as on CUDA. `--rounds` also prints each round's counts.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minicpm_cli.cli import bench, bench_many
from minicpm_cli.engine import batching
from minicpm_cli.engine.pipeline import Synthesizer
from minicpm_cli.engine.synthetic import SyntheticSpec

# aten operations that make a view or change nothing (not launches on a GPU)
VIEWS = {"select", "slice", "unsqueeze", "view", "detach", "detach_", "lift_fresh", "alias", "expand", "expand_as",
         "transpose", "t", "permute", "squeeze", "resolve_conj", "resolve_neg", "_unsafe_view", "as_strided", "split",
         "split_with_sizes", "unbind", "reshape"}
STAGES = {"_prefill_prompts": "LLM prompts", "pick_tokens": "token choices", "_start_text": "TTS starts",
          "_project": "speaker projections", "_prefill_text": "TTS text prefills", "_decode": "codec decodes"}


class Counter(TorchDispatchMode):
    """Counts the operations that compute, by the stage in `self.stage`."""

    def __init__(self):
        super().__init__()
        self.stage = "stream"
        self.counts: collections.Counter = collections.Counter()
        self.ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        empty = isinstance(out, torch.Tensor) and out.numel() == 0  # (nothing to launch)
        unchanged = name.startswith("aten.to") and any(out is a for a in args)  # (a conversion to what it was)
        if name.split(".")[1] not in VIEWS and not empty and not unchanged:
            self.counts[self.stage] += 1
            self.ops[self.stage][name] += 1
        return out

    def charged(self, fn, stage: str):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            before, self.stage = self.stage, stage
            try:
                return fn(*args, **kwargs)
            finally:
                self.stage = before

        return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--workload", choices=("reply", "read"), default="reply")
    ap.add_argument("--rounds", action="store_true", help="each round's counts too")
    a = ap.parse_args()
    synth = Synthesizer.load(None, backend="eager", device="cpu", random_weights=True, spec=SyntheticSpec.tiny(),
                             rows=a.streams)
    opts = bench.BenchOptions(backends=("eager",), random_weights=True, concurrency=a.streams)
    count = Counter()
    for name, stage in STAGES.items():
        if hasattr(batching.Engine, name):  # (an older engine may lack a stage)
                setattr(batching.Engine, name, count.charged(getattr(batching.Engine, name), stage))
    synth.llm.decode_rows = count.charged(synth.llm.decode_rows, "LLM token")
    synth.tts.step_calls = count.charged(synth.tts.step_calls, "TTS step")
    make = synth.batch

    def batch(rows=None):  # (the codec batched, as on CUDA)
        engine = make(rows)
        engine.lanes = [dataclasses.replace(lane, codec=batching.CodecLane(synth.codec, lane.row, engine._decode_wait))
                        for lane in engine.lanes]
        return engine

    synth.batch = batch
    rounds = []
    step = batching.Engine.round

    def round_(engine):
        before = collections.Counter(count.counts)
        step(engine)
        rounds.append(collections.Counter({k: v - before[k] for k, v in count.counts.items() if v > before[k]}))

    clock = bench.Clock(torch.device("cpu"))
    bench_many.streams_together(synth, a.workload, a.streams, 0, opts, clock)  # (warm-up)
    batching.Engine.round = round_
    with count:
        recs = bench_many.streams_together(synth, a.workload, a.streams, 1, opts, clock)
    first = all(r["ttfa_ms"] is not None for r in recs)
    print(f"{a.streams} {a.workload} streams, {len(rounds)} rounds, every first audio: {first}")
    print("| stage | operations | a round it ran in | most frequent |")
    print("|---|---|---|---|")
    for stage, n in count.counts.most_common():
        ran = sum(1 for r in rounds if r[stage])
        top = ", ".join(f"{op.removeprefix('aten.')} {k}" for op, k in count.ops[stage].most_common(4))
        print(f"| {stage} | {n} | {n / max(ran, 1):.0f} | {top} |")
    if a.rounds:
        for i, r in enumerate(rounds):
            print(i, dict(r))


if __name__ == "__main__":
    main()
