"""Launch shapes and per-kernel times of the LLM decode step on a GPU (a developer tool, not part of
the package: the tables in docs/journal.md and `TritonDecode.cfg` come from runs of it).

    python tools/decode_sweep.py --backend int4 --profile
    python tools/decode_sweep.py --backend int4 --sweep gate_up,down --rows 8,16 --block-k 512,1024
    python tools/decode_sweep.py --backend int4 --alt /tmp/old/backends/kernels --alt-set down=8,1024,2,3,1 --rounds 5
    python tools/decode_sweep.py --backend int4 --alt-set down=4,1024,1,4,1,1 --alt-set down=8,1024,2,4,2,1
    python tools/decode_sweep.py --backend int4 --check --alt-set gate_up_cuda=0   # the Triton gate/up
    python tools/decode_sweep.py --backend compile --invariant --profile   # the product's default token

Builds the full-size LLM with random weights (as `minicpm bench --random-weights`), prefills a
prompt, and times one decode token as CUDA-graph replays (median; the position stays put) and as
synchronised `forward` calls (as the reply loop runs them, the bench's figure). The token is the
batch-variant one (`TritonDecode`, `--batch-variant`'s) unless `--invariant` asks for the product's
default, the batch-invariant layer (backends/invariant.py, `FusedTokens`), which takes `--profile`
and `--pdl` only. `--profile` lists
the step's kernels with their time per step (torch.profiler, the kernels of the graph). `--sweep`
times every candidate launch shape of the named kernels (`TritonDecode.cfg`: rows per program, K
per iteration, warps, stages[, split], pipe; "attn": cache slots per block, warps), one kernel at a time
with the others at their current shapes, and prints the best of each. `--alt` / `--alt-set` time other
variants of the step (the kernels of another copy of the backends/kernels folder, such as
`git archive <commit> backends/kernels | tar -x -C /tmp/old` makes; launch shapes, one variant per
`--alt-set`) against the current one, alternating for `--rounds` rounds on the same model and
position (the medians of each, so that drift of the GPU's clocks falls on all of them).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from minicpm_cli import backends  # noqa: E402
from minicpm_cli.engine.pipeline import LLM_CONTEXT  # noqa: E402
from minicpm_cli.engine.synthetic import RandomCheckpoint, SyntheticSpec  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def token_key(llm):
    """The key of one row's token graph: the batch-variant "decode", or the invariant layer's batch
    of one row (`CompiledLLM.decode_rows`)."""
    return ("batch", 1, llm.max_len) if llm.invariant else "decode"


def replay_ms(llm, n: int) -> float:
    return graph_ms(llm.graphs.graphs[token_key(llm)][0], n)


def graph_ms(graph, n: int) -> float:
    """Median ms of n replays of a CUDA graph, the first tenth left out (warm-up)."""
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[n // 10:])


def forward_ms(llm, n: int, pos: int) -> float:
    times = []
    for i in range(n):
        llm.pos = pos  # the same position every token: comparable runs
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        llm.forward([100 + i % 64])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[n // 10:])


def recapture(llm, pos: int) -> None:
    llm.graphs.graphs.pop(token_key(llm), None)
    llm.pos = pos
    llm.forward([5])
    torch.cuda.synchronize()


def profile(llm, steps: int = 10) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    graph = llm.graphs.graphs[token_key(llm)][0]
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name.split("(")[0][:48]
            per[name][0] += ev.device_time_total
            per[name][1] += 1
    total = sum(us for us, _ in per.values()) / steps
    print(f"kernels, one step: {total:.0f} us in all (with PDL, kernels overlap)")
    for name, (us, count) in sorted(per.items(), key=lambda kv: -kv[1][0]):
        print(f"  {name:48s} {us / steps:8.1f} us/step {count // steps:4d}x {us / count:7.2f} us each")


def shapes(text: str) -> dict[str, tuple]:
    """`name=r,k,w,s[,split][,pipe];...` -> launch shapes for `TritonDecode.cfg`."""
    out = {}
    for item in [x for x in text.split(";") if x]:
        name, vals = item.split("=")
        out[name.strip()] = tuple(ints(vals))
    return out


def reshape(td, cfg: dict, dev, mod=None) -> None:
    """Launch shapes `cfg` on top of `td.cfg`, and the split-K scratch they need (`kernels_scratch`
    of `mod`, the decode module of td's kernels; default backends/kernels/decode.py)."""
    if mod is None:
        from minicpm_cli.backends.kernels import decode as mod
    td.cfg.update(cfg)
    td.scratch = mod.kernels_scratch(td.cfg, td.weights[0][1], td.weights[0][3], dev)


def alt_decode(path: str):
    """The decode module of the kernels folder at `path`, imported as a package beside
    backends.kernels (so that its relative imports, `..cuda` too, resolve as the original's)."""
    name = "minicpm_cli.backends.alt_kernels"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(path) / "__init__.py",
                                                      submodule_search_locations=[str(path)])
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return importlib.import_module(f"{name}.decode")


def variant(llm, path: str | None, cfg: dict, dev):
    """A TritonDecode over the same model with the kernels of `path`, a copy of the backends/kernels
    folder (default: backends/kernels itself), and launch shapes `cfg` on top of its defaults."""
    from minicpm_cli.backends.kernels import decode as mod

    if path:
        mod = alt_decode(path)
    td = mod.TritonDecode(llm.triton.decoder)
    reshape(td, cfg, dev, mod)
    return td


def get_shape(td, name: str) -> tuple:
    """A kernel's launch shape: `TritonDecode.cfg[name]`, or for "attn" (slots per block, warps)."""
    return (td.block_s, td.attn_warps) if name == "attn" else td.cfg[name]


def set_shape(td, name: str, shape: tuple, dev) -> None:
    if name == "attn":
        td.block_s, td.attn_warps = shape
    else:
        reshape(td, {name: shape}, dev)


def candidates(name: str, args) -> list[tuple]:
    """Launch shapes of `--rows` x `--block-k` x `--warps` x `--stages` (x `--split` for o and down)
    x `--pipe`."""
    out = []
    splits = args.split if name in ("o", "down") else [None]
    for r, k, w, s, sp, p in itertools.product(args.rows, args.block_k, args.warps, args.stages, splits, args.pipe):
        out.append((r, k, w, s) + ((sp,) if sp is not None else ()) + (p,))
    return list(dict.fromkeys(out))


def check(llm, variants: dict, pos: int) -> None:
    """The logits of one token at `pos` from each variant (name -> TritonDecode) against the first's."""
    out = {}
    for name, t in variants.items():
        llm.triton = t
        recapture(llm, pos)  # (runs a token: back to pos for the compared one)
        llm.pos = pos
        out[name] = llm.forward([123])[0].clone()
    ref = out.pop(next(iter(variants)))
    for name, logits in out.items():
        same = logits.argmax().item() == ref.argmax().item()
        print(f"check {name}: logits max |diff| {(logits - ref).abs().max().item():.3g} "
              f"(of max |logit| {ref.abs().max().item():.3g}), same argmax {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="int4", choices=["compile", "int4"])
    ap.add_argument("--prompt", type=int, default=350, help="tokens before the timed position")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--pdl", choices=["on", "off", "both"], default="on")
    ap.add_argument("--sweep", default="", help="kernels to sweep: qkv,o,gate_up,down")
    ap.add_argument("--rows", type=ints, default=[8, 16])
    ap.add_argument("--block-k", type=ints, default=[512, 1024])
    ap.add_argument("--warps", type=ints, default=[2, 4, 8])
    ap.add_argument("--stages", type=ints, default=[2, 3])
    ap.add_argument("--split", type=ints, default=[1])
    ap.add_argument("--pipe", type=ints, default=[0], help="1: 4-bit words through Triton's pipelining (PIPE)")
    ap.add_argument("--block-s", type=ints, default=[16, 32, 64], help="attention: cache slots per block (--sweep attn)")
    ap.add_argument("--set", type=shapes, default={},
                    help="launch shapes of the current variant: 'down=8,1024,2,2,2;o=...'")
    ap.add_argument("--alt", default=None,
                    help="a copy of the backends/kernels folder to time against the current one")
    ap.add_argument("--alt-set", type=shapes, action="append", default=None,
                    help="launch shapes of the second variant (again: a third, ...; all alternate)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--check", action="store_true",
                    help="before timing, compare each variant's logits for one token with the current kernels'")
    ap.add_argument("--invariant", action="store_true",
                    help="the batch-invariant token (the product's default) instead of TritonDecode's")
    args = ap.parse_args()
    if args.invariant and (args.alt or args.alt_set or args.sweep or args.set or args.check):
        ap.error("--invariant times and profiles the invariant layer as it is: no --alt, --sweep, --set or --check")

    dev = torch.device("cuda")
    ckpt = RandomCheckpoint(SyntheticSpec.full())
    llm = backends.get(args.backend).create(ckpt, ckpt.config, device=dev, dtype=torch.bfloat16, max_len=LLM_CONTEXT,
                                            invariant=args.invariant)
    td = llm.triton
    if args.invariant and llm.tokens is None:
        sys.exit("this model's layers do not fit the invariant token layer (FusedTokens.fits): nothing to time")
    kind = "batch-invariant token" if llm.invariant else "TritonDecode token"
    print(f"{torch.cuda.get_device_name()} | {llm.version} | {args.backend}, {kind}, position {args.prompt}")
    llm.reset()
    llm.forward(list(range(1000, 1000 + args.prompt)))
    pos = llm.pos
    if not llm.invariant:
        reshape(td, args.set, dev)

    def measure(label: str) -> float:
        recapture(llm, pos)
        rep, fwd = replay_ms(llm, args.reps), forward_ms(llm, args.reps, pos)
        print(f"{label}: graph replay {rep:.3f} ms, forward {fwd:.3f} ms", flush=True)
        return rep

    if args.alt or args.alt_set is not None:
        variants = {"current": td}  # then one per --alt-set (none given: --alt's kernels as they are)
        for n, cfg in enumerate(args.alt_set or [{}]):
            variants[f"alt{n + 1 if n else ''}"] = variant(llm, args.alt, cfg, dev)
        if args.check:
            check(llm, variants, pos)
        got = {name: ([], []) for name in variants}
        for r in range(args.rounds):
            for name, t in variants.items():
                llm.triton = t
                recapture(llm, pos)
                got[name][0].append(replay_ms(llm, args.reps))
                got[name][1].append(forward_ms(llm, args.reps, pos))
            last = ", ".join(f"{n} {got[n][0][-1]:.3f}/{got[n][1][-1]:.3f}" for n in variants)
            print(f"round {r + 1} (replay/forward ms): {last}", flush=True)
        for name, t in variants.items():
            print(f"{name} ({t.cfg}): graph replay median {statistics.median(got[name][0]):.3f} ms, "
                  f"forward median {statistics.median(got[name][1]):.3f} ms")
        llm.triton = td
    pdls = [True, False] if args.pdl == "both" else [args.pdl == "on"]
    if llm.invariant and not llm.tokens.pdl:  # (PDL only where FusedTokens found it: Hopper on, its products)
        pdls = [False]
    for pdl in pdls:
        (llm.tokens if llm.invariant else td).pdl = pdl
        measure(f"step, PDL {'on' if pdl else 'off'}" + ("" if llm.invariant else f", cfg {td.cfg}"))
        if args.profile:
            profile(llm)
    for name in [n for n in args.sweep.split(",") if n]:
        base = get_shape(td, name)
        results = []
        cands = ([(b, w) for b in args.block_s for w in args.warps] if name == "attn" else candidates(name, args))
        for cand in cands:
            set_shape(td, name, cand, dev)
            try:
                results.append((measure(f"  {name} {cand}"), cand))
            except Exception as e:  # a shape Triton cannot compile (shared memory, registers)
                print(f"  {name} {cand}: failed ({str(e).splitlines()[0][:100]})")
        best = min(results) if results else (None, base)
        set_shape(td, name, best[1], dev)
        print(f"best {name}: {best[1]} ({best[0]:.3f} ms; was {base})" if results else f"{name}: nothing ran")


if __name__ == "__main__":
    main()
