"""One-query attention over many rows (backends/kernels/attention.py, `attend_rows`) on a GPU: mode
"dot"'s outputs (grouped heads on the tensor cores) against "head"'s, and row 0's at every row
count, then each mode's time a launch (CUDA-graph replays) at the TTS's and the LLM's shapes, per
number of rows and position. `attend_mode` comes from this.

    python tools/attend_sweep.py [--nb 1 4 8 16 32 64 128] [--pos 100 350 600 1100] [--shape tts llm]
                                 [--warps 2 8]

Rows sit at positions pos, pos + 3, ... (37 apart at most), every slot visible (the TTS's text mask
all seen; the LLM's causal); the bit checks add hidden slots and positions past 16 blocks. Random
bfloat16 K/V in a cache of the model's head counts and length.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minicpm_cli.backends.kernels.attention import attend_mode, attend_rows  # noqa: E402

SHAPES = {"tts": (12, 12, 64, 2400), "llm": (28, 4, 128, 2048)}  # heads, KV heads, head dim, cache slots
MODES = ("head", "dot")
BLOCK_S = 64


def case(shape: str, rows: int, pos0: int, masked: bool, seed: int = 0) -> dict:
    heads, hkv, d, slots = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(rows, hkv, slots, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(rows, hkv, slots, d, device="cuda", generator=g).bfloat16()
    pos = (pos0 + torch.arange(rows, device="cuda") % 37 * 3).clamp(max=slots - 1)
    vis = torch.zeros(rows, slots, dtype=torch.long, device="cuda") if shape == "tts" else None
    if masked and vis is not None:
        vis = torch.randint(0, 400, (rows, slots), device="cuda", generator=g)
        vis[torch.arange(rows), pos] = 0
    splits = min(triton.cdiv(slots, BLOCK_S), 16)
    return dict(q=torch.randn(rows, heads * d, device="cuda", generator=g).bfloat16(), k=k, v=v, vis=vis, pos=pos,
                part=torch.zeros(rows * heads * splits * (d + 2), device="cuda"),
                count=torch.zeros(rows * heads, dtype=torch.int32, device="cuda"), heads=heads, splits=splits)


def attend(c: dict, nb: int, mode: str, out: torch.Tensor, warps: int = 4) -> None:
    attend_rows(c["q"], c["k"], c["v"], c["vis"], c["pos"], out, c["part"], c["count"], nb=nb, heads=c["heads"],
                splits=c["splits"], block_s=BLOCK_S, mode=mode, warps=warps)


def replay_us(fn, launches: int = 20, rounds: int = 7) -> float:
    """Median time of one launch of fn, replayed in a CUDA graph of `launches`."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per = []
    for _ in range(rounds):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        per.append(start.elapsed_time(end) * 1000 / launches)
    return statistics.median(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nb", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--pos", type=int, nargs="+", default=[100, 350, 600, 1100])
    ap.add_argument("--shape", nargs="+", choices=tuple(SHAPES), default=list(SHAPES))
    ap.add_argument("--warps", type=int, nargs="+", default=[], help="also time mode 'head' at these warps a program "
                    "(and compare its bits with 4 warps')")
    args = ap.parse_args()
    rows = max(args.nb)
    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    differ, worst = 0, 0.0
    for shape in args.shape:
        heads, hkv = SHAPES[shape][:2]
        for pos0 in (*args.pos, 2000):
            for masked in (False, True) if shape == "tts" else (False,):
                c = case(shape, rows, pos0, masked)
                ref, out = torch.zeros_like(c["q"]), torch.zeros_like(c["q"])
                first_row = {}  # "dot": row 0's output at each row count
                for nb in sorted({1, 7, rows}):
                    attend(c, nb, "head", ref)
                    if heads > hkv:  # its own bits, near "head"'s
                        attend(c, nb, "dot", out)
                        top = ref[:nb].float().abs().max()
                        worst = max(worst, ((out[:nb].float() - ref[:nb].float()).abs().max() / top).item())
                        first_row[nb] = out[:1].clone()
                if any(not torch.equal(v, first_row[1]) for v in first_row.values()):
                    differ += 1
                    print(f"DIFFER {shape} pos {pos0}: 'dot' row 0 changes with the rows beside it")
    print(f"bits: {'dot the same at every row count' if not differ else f'{differ} cases differ'}; dot against "
          f"head: largest difference {worst:.2e} of the largest output")
    for w in args.warps:
        for shape in args.shape:
            c = case(shape, rows, 350, shape == "tts")
            ref, out = torch.zeros_like(c["q"]), torch.zeros_like(c["q"])
            attend(c, rows, "head", ref)
            attend(c, rows, "head", out, w)
            print(f"bits: {shape}, {w} warps {'equal to' if torch.equal(out, ref) else 'differ from'} 4 warps'")
    print("shape   pos   nb  " + "  ".join(f"{m:>7s} us" for m in MODES)
          + "".join(f"  head/{w}w us" for w in args.warps) + "  chosen")
    for shape in args.shape:
        heads, hkv = SHAPES[shape][:2]
        for pos0 in args.pos:
            c = case(shape, rows, pos0, False)
            out = torch.zeros_like(c["q"])
            for nb in args.nb:
                t = [replay_us(lambda: attend(c, nb, m, out)) for m in MODES]
                t += [replay_us(lambda: attend(c, nb, "head", out, w)) for w in args.warps]
                print(f"{shape:5s} {pos0:5d} {nb:4d}  " + "  ".join(f"{x:10.1f}" for x in t)
                      + f"  {attend_mode(heads // hkv)}", flush=True)


if __name__ == "__main__":
    main()
