"""Launch shapes of the 4-bit prefill product `q4_mm` on a GPU, against cuBLAS on bf16 weights (a
developer tool, not part of the package; the shapes in `q4_mm_config` come from runs of it).

    python tools/q4mm_sweep.py --m 64,128 --jobs 12
    python tools/q4mm_sweep.py --m 1 --decode        # q4_mm as a one-token product, vs the GEMV
    python tools/q4mm_sweep.py --kernels /tmp/old/backends/kernels   # another copy of the kernels folder

For every Qwen2-7B projection shape (q/k/v, o, gate/up, down) and token count M it times, as CUDA
graph replays over enough copies of the weights that they do not stay in L2: cuBLAS on bf16
weights, `q4_mm` at its current launch shape and at every candidate shape, and with `--decode`
the decode GEMV (`gemv` at `TritonDecode`'s 4-bit shapes). Each result is checked against the
float32 product with the dequantized weights (relative error of the whole output). Candidates
are compiled first by `--jobs` worker processes into Triton's on-disk cache, so that the timed
process only loads them. The table at the end gives, per shape and M, the best candidate and
the microseconds per layer of the best shapes.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import multiprocessing as mp
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
DECODE_CFG = {"qkv": (8, 1024, 4, 2, 1), "o": (8, 1024, 4, 2, 1), "gate_up": (8, 512, 2, 2, 1),
              "down": (8, 1024, 2, 2, 2)}  # TritonDecode.cfg's 4-bit shapes (rows, K-block, warps, stages, split)
L2_ROTATE_BYTES = 256 << 20  # the weight copies a timing rotates through


KERNELS_ENV = "Q4MM_SWEEP_KERNELS"  # --kernels, passed on to the compile workers


def use_kernels() -> None:
    """Make the folder named by KERNELS_ENV (a copy of backends/kernels) the `backends.kernels`
    package that the sweep imports."""
    path = os.environ.get(KERNELS_ENV)
    if path and "minicpm_cli.backends.kernels" not in sys.modules:
        spec = importlib.util.spec_from_file_location("minicpm_cli.backends.kernels", Path(path) / "__init__.py",
                                                      submodule_search_locations=[path])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["minicpm_cli.backends.kernels"] = mod
        spec.loader.exec_module(mod)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def weight(n: int, k: int, dev, seed: int):
    """A random one-group 4-bit weight in the kernels' layout, and its values q (n, k) uint8."""
    from minicpm_cli.backends.gptq import kernel_words
    from minicpm_cli.backends.kernels.common import Weight

    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=dev, generator=g)
    packed = kernel_words(q.int())
    scales = torch.full((n, 1), 0.02 / 4.6, dtype=torch.float32, device=dev)
    zeros = torch.full((n, 1), 8.0, dtype=torch.float32, device=dev)
    return Weight(packed, scales, zeros, k), q


def candidates(m: int, decode: bool, wide: bool = False) -> list[tuple]:
    """(BLOCK_N, BLOCK_T, BLOCK_K, warps, stages, split) to try for m tokens; a split of 0 or less
    asks for about 1 - split programs per SM (`resolve`). `wide`: the first sweep's whole grid;
    else the shapes that it left in question (small tiles, several tiles of 64 tokens)."""
    bt = min(max(16, 1 << (m - 1).bit_length()), 128)
    if decode:
        return [(bn, bt, bk, w, s, 1) for bn, bk, w, s in itertools.product((16, 32, 64), (128, 256, 512), (2, 4),
                                                                             (2, 3, 4))]
    if wide:
        out = [(bn, bt, bk, w, s, 0) for bn, bk, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))]
        out += [(256, bt, bk, 8, 3, 0) for bk in (32, 64)]
        return out + [(bn, bt, 64, 4, 3, sp) for bn in (64, 128) for sp in (1, -1)]
    if bt <= 32:
        return [(64, bt, bk, 4, s, sp) for bk in (64, 128) for s in (3, 4, 5) for sp in (-3, -5)]
    if m > 128:  # several tiles of 128 tokens, or tiles of 256
        return [(64, 128, bk, 4, s, sp) for bk in (64, 128) for s in (3, 4) for sp in (0, -1, -3)] + [
            (64, 64, 64, 4, 4, sp) for sp in (0, -1)] + [
            (bn, 256, bk, bn // 16, s, sp) for bn in (64, 128) for bk in (32, 64) for s in (3, 4) for sp in (0, -1)]
    out = [(bn, bt, bk, 4, s, sp) for bn, bk in ((64, 64), (64, 128), (128, 64)) for s in (3, 4, 5)
           for sp in (0, -1, -3)]
    out += [(128, bt, 64, 8, 4, 0), (128, bt, 64, 8, 4, -1), (128, bt, 128, 8, 3, 0)]
    if bt == 128:  # two tiles of 64 tokens
        out += [(64, 64, 64, 4, 4, 0), (64, 64, 64, 4, 4, -1)]
    return out


def resolve(cfg: tuple, m: int, w) -> tuple:
    """A candidate with its split made concrete: 1 - split programs per SM when split <= 0."""
    from minicpm_cli.backends.kernels.common import sm_count
    from minicpm_cli.backends.kernels.q4 import q4_mm_split

    bn, bt, bk, warps, stages, split = cfg
    if split <= 0:
        split = q4_mm_split(m, w, bn, bt, bk, (1 - split) * sm_count(w.w.device))
    return bn, bt, bk, warps, stages, split


def precompile(jobs: list[tuple]) -> None:
    """Worker: compile (shape, m, cfg) jobs into Triton's cache by running each once."""
    use_kernels()
    from minicpm_cli.backends.kernels.q4 import q4_mm

    dev = torch.device("cuda")
    made = {}
    for name, m, cfg in jobs:
        n, k = SHAPES[name]
        if name not in made:
            made[name] = weight(n, k, dev, 0)[0]
        w = made[name]
        x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
        try:
            q4_mm(x, w, None, resolve(cfg, m, w))
        except Exception:  # reported by the timed pass
            pass
    torch.cuda.synchronize()


def bench_us(fn_list) -> float:
    """Median time of one call, as CUDA-graph replays of the calls in fn_list (one per weight copy)."""
    import triton.testing

    def run():
        for f in fn_list:
            f()

    return triton.testing.do_bench_cudagraph(run, rep=20, return_mode="median") * 1e3 / len(fn_list)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=ints, default=[64, 128])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--decode", action="store_true", help="one-token candidates (and the GEMV)")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--wide", action="store_true", help="the first sweep's grid of shapes")
    ap.add_argument("--repeat", type=int, default=3, help="correctness checks per shape, fresh inputs each")
    ap.add_argument("--current", action="store_true", help="time q4_mm_config's shapes only")
    ap.add_argument("--kernels", default=None,
                    help="a copy of the backends/kernels folder to time instead of the current one")
    args = ap.parse_args()

    if args.kernels:
        os.environ[KERNELS_ENV] = str(Path(args.kernels).resolve())
    use_kernels()
    from minicpm_cli.backends.kernels.common import SplitScratch
    from minicpm_cli.backends.kernels.matvec import gemv
    from minicpm_cli.backends.kernels.q4 import q4_linear, q4_mm, q4_mm_config

    dev = torch.device("cuda")
    names = [s for s in args.shapes.split(",") if s]
    cands = (lambda m: []) if args.current else (lambda m: candidates(m, args.decode, args.wide))
    plan = [(name, m, cfg) for m in args.m for name in names for cfg in cands(m)]
    if args.jobs > 1:
        ctx = mp.get_context("spawn")
        with ctx.Pool(args.jobs) as pool:
            pool.map(precompile, [plan[i::args.jobs] for i in range(args.jobs)])
    print(f"{torch.cuda.get_device_name()}: {len(plan)} candidates", flush=True)
    summary = []
    for name in names:
        n, k = SHAPES[name]
        w0, q = weight(n, k, dev, 0)
        deq = ((q.float() - 8.0) * (0.02 / 4.6)).to(torch.bfloat16)  # exactly the 4-bit values
        del q
        copies = max(1, L2_ROTATE_BYTES // (n * k // 2))
        ws = [w0] + [weight(n, k, dev, i)[0] for i in range(1, copies)]
        dense = [deq] + [deq.clone() for _ in range(min(copies, max(1, L2_ROTATE_BYTES // (n * k * 2))) - 1)]
        for m in args.m:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            ref = x.float() @ deq.float().T
            cub = bench_us([lambda d=d: x @ d.T for d in dense])
            rows = []
            if args.decode and m == 1:
                r, bk, wp, st, sp = DECODE_CFG[name]
                out = torch.empty(n, dtype=torch.bfloat16, device=dev)
                kw = dict(rows=r, block_k=bk, warps=wp, stages=st, split=sp, scratch=SplitScratch(dev))
                us = bench_us([lambda w=w: gemv(w, x[0], out, **kw) for w in ws])
                gemv(w0, x[0], out, **kw)
                err = ((out.float() - ref[0]).norm() / ref.norm()).item()
                rows.append((us, f"gemv {DECODE_CFG[name]}", err))
            if m > 1:  # what a prefill runs: `q4_mm` up to MM_MAX_M tokens, else dequantize + cuBLAS
                err = ((q4_linear(x, w0, None).float() - ref).norm() / ref.norm()).item()
                rows.append((bench_us([lambda w=w: q4_linear(x, w, None) for w in ws]), "q4_linear", err))
            base = q4_mm_config(m, w0)
            for cfg in [base] + cands(m):
                cfg = resolve(cfg, m, w0)
                try:
                    err = 0.0
                    for r in range(args.repeat):
                        xr = x if r == 0 else torch.randn(m, k, dtype=torch.bfloat16, device=dev)
                        yr = q4_mm(xr, w0, None, cfg)
                        rr = ref if r == 0 else xr.float() @ deq.float().T
                        err = max(err, ((yr.float() - rr).norm() / rr.norm()).item())
                    us = bench_us([lambda w=w: q4_mm(x, w, None, cfg) for w in ws])
                except Exception as e:
                    print(f"  {name} M={m} {cfg}: failed ({str(e).splitlines()[0][:80]})", flush=True)
                    continue
                rows.append((us, ("current " if cfg == base else "") + str(cfg), err))
            rows.sort()
            print(f"{name} (N={n}, K={k}) M={m}: cuBLAS bf16 {cub:.1f} us", flush=True)
            for us, label, err in [r for r in rows if r[2] <= 1e-2][:args.top]:
                print(f"  {us:7.1f} us  {label}  rel.err {err:.1e}", flush=True)
            for us, label, err in [r for r in rows if r[2] > 1e-2]:
                print(f"  WRONG: {label} rel.err {err:.1e}", flush=True)
            cur = next((r[0] for r in rows if r[1].startswith("current")), float("nan"))
            best = next((r for r in rows if r[2] <= 1e-2), (float("nan"), "none right"))
            summary.append((name, m, cub, cur, best[0], best[1]))
        del ws, dense, deq
        torch.cuda.empty_cache()
    print("\n| shape | M | cuBLAS bf16 (us) | q4_mm current (us) | best (us) | best shape |")
    print("|---|---|---|---|---|---|")
    for name, m, cub, cur, best, label in summary:
        print(f"| {name} | {m} | {cub:.1f} | {cur:.1f} | {best:.1f} | {label} |")
    for m in args.m:
        tot = [sum(r[i] for r in summary if r[1] == m) for i in (2, 3, 4)]
        print(f"per layer, M={m}: cuBLAS {tot[0]:.0f} us, q4_mm current {tot[1]:.0f} us, best shapes {tot[2]:.0f} us")


if __name__ == "__main__":
    main()
