"""Launch shapes of the batch-invariant products, kept to the bits of the current shape (a
developer tool, not part of the package: `mm_config`'s prompt shapes for 17-32, 33-64 and 129-512
tokens come from runs of it; its one-token sweeps found nothing more than 1% faster on an H100 or
2-4% on an H200, docs/journal.md).

    python tools/invariant_sweep.py --kind bf16 --m 1           # invariant_mm (compile's products)
    python tools/invariant_sweep.py --kind q4 --m 1 --jobs 14   # q4_invariant (int4's)
    python tools/invariant_sweep.py --kind q4 --m 64,256        # a prompt's tokens

The single stream's LLM token runs every projection at one token on the batch-invariant products
(backends/invariant.py), whose shapes were chosen for bits first: what a row sums does not depend
on how the work is cut into programs (rows of the weight a program, K a loop iteration, warps,
pipelining stages), and for the 4-bit product not on the K-block either, as long as each split of
K covers the same inputs. This tries such cuts for each Qwen2-7B projection (and lm_head for bf16)
as CUDA-graph replays over copies of the weights that do not stay in L2, and keeps a candidate only
if its outputs equal the current shape's bit for bit on `--repeat` fresh inputs (the current shape's
bits being the ones every token count gives: tests/test_invariant.py). A kept shape still enters
the product only with that test at the 7B's shapes on a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from q4mm_sweep import L2_ROTATE_BYTES, bench_us, ints, weight  # noqa: E402

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944),
          "lm_head": (152064, 3584)}
BIAS = {"qkv"}


def current(kind: str, name: str, m: int, w) -> tuple:
    """The launch shape the product takes now for m tokens."""
    from minicpm_cli.backends.kernels import targets
    from minicpm_cli.backends.kernels.gemm import mm_config
    from minicpm_cli.backends.kernels.q4 import q4_invariant_config

    n, k = SHAPES[name]
    if kind == "bf16":
        return mm_config(m, n, k, targets.capability(torch.device("cuda")), torch.bfloat16)
    return q4_invariant_config(m, w)


def same_split(k: int, bk: int, split: int, bk0: int) -> int | None:
    """A split parameter that gives K-block bk the same inputs a split as (bk0, split), or None."""
    from minicpm_cli.backends.kernels.common import split_k

    want = split_k(k, bk0, split)
    if want[1] % bk:
        return None
    return next((s for s in range(1, 256) if split_k(k, bk, s) == want), None)


def candidates(kind: str, name: str, m: int, base: tuple) -> list[tuple]:
    """Cuts to try for m tokens: one token (the single stream's token) its own grid; a prompt's
    tokens tiles from half the count's power of two (at most 128) up to that power (at least 32)."""
    n, k = SHAPES[name]
    if m == 1:
        bts, grid = (base[1],), ((16, 32, 64, 128) if kind == "bf16" else (32, 64, 128),
                                 (128, 256, 512) if kind == "bf16" else (64, 128, 256),
                                 (2, 4, 8) if kind == "bf16" else (4, 8), (4, 6, 8, 10) if kind == "bf16" else (3, 4, 6))
    else:
        p2 = 1 << (m - 1).bit_length()
        bts = tuple(bt for bt in (16, 32, 64, 128, 256) if min(p2 // 2, 128) <= bt <= max(p2, 32))
        # (weight rows a program from 16: a short prompt's o and down have 56 programs at 64 rows;
        # the 16-token tile for 9-32 tokens, 4-bit sweeps included)
        grid = ((16, 32, 64, 128), (64, 128, 256), (2, 4, 8), (3, 4, 6)) if kind == "bf16" else \
            ((64, 128), (64, 128), (4, 8), (3, 4))
    out = []
    for bt in bts:
        for bn, bk, w, s in itertools.product(*grid):
            if kind == "bf16":
                out.append((bn, bt, bk, w, s))
            elif (sp := same_split(k, bk, base[5], base[2])) is not None:
                out.append((bn, bt, bk, w, s, sp))
    return out


def product(kind: str):
    if kind == "bf16":
        from minicpm_cli.backends.kernels.gemm import invariant_mm
        return lambda x, w, b, cfg: invariant_mm(x, w, b, cfg=cfg)
    from minicpm_cli.backends.kernels.q4 import q4_mm
    return lambda x, w, b, cfg: q4_mm(x, w, b, cfg=cfg)


def make_weight(kind: str, name: str, dev, seed: int):
    n, k = SHAPES[name]
    if kind == "bf16":
        g = torch.Generator(device=dev).manual_seed(seed)
        return torch.randn(n, k, dtype=torch.bfloat16, device=dev, generator=g) * 0.02
    return weight(n, k, dev, seed)[0]


def nbytes(kind: str, name: str) -> int:
    n, k = SHAPES[name]
    return n * k * 2 if kind == "bf16" else n * k // 2


def precompile(jobs: list[tuple]) -> None:
    """Worker: compile (kind, shape, m, cfg) jobs into Triton's cache by running each once."""
    dev = torch.device("cuda")
    made = {}
    for kind, name, m, cfg in jobs:
        n, k = SHAPES[name]
        if (kind, name) not in made:
            made[kind, name] = make_weight(kind, name, dev, 0)
        bias = torch.zeros(n, dtype=torch.bfloat16, device=dev) if name in BIAS else None
        try:
            product(kind)(torch.randn(m, k, dtype=torch.bfloat16, device=dev), made[kind, name], bias, cfg)
        except Exception:  # reported by the timed pass
            pass
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=("bf16", "q4"), default="bf16")
    ap.add_argument("--m", type=ints, default=[1])
    ap.add_argument("--shapes", default=None, help="comma-separated, of " + ",".join(SHAPES))
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--repeat", type=int, default=3, help="bit checks a candidate, fresh inputs each")
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args()

    kind = args.kind
    names = args.shapes.split(",") if args.shapes else [s for s in SHAPES if s != "lm_head" or (kind, args.m) == ("bf16", [1])]
    dev = torch.device("cuda")
    w_probe = {name: make_weight(kind, name, dev, 0) for name in names}
    plans = {(name, m): candidates(kind, name, m, current(kind, name, m, w_probe[name])) for name in names for m in args.m}
    del w_probe
    jobs = [(kind, name, m, cfg) for (name, m), cands in plans.items() for cfg in cands]
    if args.jobs > 1:
        with mp.get_context("spawn").Pool(args.jobs) as pool:
            pool.map(precompile, [jobs[i::args.jobs] for i in range(args.jobs)])
    print(f"{torch.cuda.get_device_name()}: {kind}, {len(jobs)} candidates", flush=True)
    run = product(kind)
    summary = []
    for name in names:
        n, k = SHAPES[name]
        copies = max(1, L2_ROTATE_BYTES // nbytes(kind, name))
        ws = [make_weight(kind, name, dev, i) for i in range(copies)]
        bias = torch.randn(n, dtype=torch.bfloat16, device=dev) if name in BIAS else None
        for m in args.m:
            base = current(kind, name, m, ws[0])
            xs = [torch.randn(m, k, dtype=torch.bfloat16, device=dev) for _ in range(args.repeat)]
            refs = [run(x, ws[0], bias, base) for x in xs]
            rows, differ = [], []
            for cfg in [base] + plans[name, m]:
                try:
                    same = all(torch.equal(run(x, ws[0], bias, cfg), r) for x, r in zip(xs, refs))
                    us = bench_us([lambda w=w: run(xs[0], w, bias, cfg) for w in ws])
                except Exception as e:
                    print(f"  {name} M={m} {cfg}: failed ({str(e).splitlines()[0][:80]})", flush=True)
                    continue
                (rows if same else differ).append((us, ("current " if cfg == base else "") + str(cfg)))
            rows.sort()
            gbs = nbytes(kind, name) / 1e6
            print(f"{name} (N={n}, K={k}) M={m}: {len(rows)} give the current bits, {len(differ)} do not", flush=True)
            for us, label in rows[:args.top]:
                print(f"  {us:7.1f} us  {gbs / us:5.2f} TB/s  {label}", flush=True)
            for us, label in sorted(differ)[:3]:
                print(f"  other bits: {us:7.1f} us  {label}", flush=True)
            cur = next((r[0] for r in rows if r[1].startswith("current")), float("nan"))
            summary.append((name, m, cur, rows[0][0] if rows else float("nan"), rows[0][1] if rows else "-"))
        del ws
        torch.cuda.empty_cache()
    print("\n| shape | M | current (us) | best, same bits (us) | best shape |")
    print("|---|---|---|---|---|")
    for name, m, cur, best, label in summary:
        print(f"| {name} | {m} | {cur:.1f} | {best:.1f} | {label} |")


if __name__ == "__main__":
    main()
