"""What bounds the 4-bit GEMVs of the LLM decode step (gate/up, down): memory, or the arithmetic?
(a developer tool, like tools/decode_sweep.py; the findings are in docs/journal.md)

    python tools/gemv_probe.py --modes kernel,loads,L2 --inter 8448,16896,18944,25344
    python tools/gemv_probe.py --lean "4,512,1,0,3;8,512,2,0,0" --down "8,1024,2,3,2" --chain

Times, as CUDA-graph replays of `--layers` launches on as many weight copies (no L2 reuse from
one launch to the next, as in a decode step), with PDL as the decode step launches them, the
median time a launch (or, with `--chain`, a pair of launches) over `--rounds` rounds:
- `kernel`: the decode step's gate/up kernel (`rms_gate_up`, 4-bit; and bf16 for reference);
- `full`: a copy of it with the grid's rows set by `--inter` (`--maxnreg`: a register limit);
- `loads`: the same program grid and weight loads, with the arithmetic replaced by an XOR of the
  words (what the memory side allows for this access pattern and occupancy);
- `L2`: the whole kernel, but every program reads the rows of one of `--row-blocks` row blocks
  (the weights stay in L2: what the arithmetic allows);
- `--lean`: gate/up without masks, its words prefetched into registers or through Triton's
  pipelining, optionally with precomputed scaled inputs or an L2 prefetch before the wait;
- `--down-current` / `--down`: down on the decode kernel (`gemv`) and on a copy with its words
  through Triton's pipelining (and its loads alone);
- `--chain`: every gate/up launch after an o projection, every down launch after a gate/up
  launch, as in a decode step.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from minicpm_cli.backends.kernels import common, decode, matvec  # noqa: E402
from decode_sweep import graph_ms  # noqa: E402


@triton.jit
def _probe(x_ptr, nw_ptr, w_ptr, s_ptr, z_ptr, h_ptr, eps, DIM: tl.constexpr, INTER: tl.constexpr,
           GS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, VW: tl.constexpr, STAGES: tl.constexpr,
           MODE: tl.constexpr, ROWMOD: tl.constexpr, PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    if ROWMOD > 0:
        pid = pid % ROWMOD
    row0 = pid * BLOCK_R
    rows = row0 + tl.arange(0, BLOCK_R)
    rm = rows < INTER
    dtype = x_ptr.dtype.element_ty
    pre = matvec.load_words(w_ptr, row0, row0 + INTER, INTER, 0, DIM, BLOCK_R, BLOCK_K, True, True)
    if MODE == 1:  # loads only
        common.wait_previous(PDL, False)
        acc = tl.zeros([BLOCK_K // 8, BLOCK_R // 4, 4], dtype=tl.int32)
        for i in tl.range(0, DIM, BLOCK_K, num_stages=STAGES):
            nxt = matvec.load_words(w_ptr, row0, row0 + INTER, INTER, i + BLOCK_K, DIM, BLOCK_R, BLOCK_K, True, True)
            acc = acc ^ pre[0] ^ pre[1]
            pre = nxt
        common.let_next(PDL)
        t = tl.reshape(tl.xor_sum(acc, 0), [BLOCK_R])
        tl.store(h_ptr + rows, t.to(tl.int16).to(dtype, bitcast=True), mask=rm)
    else:
        sc_g, z_g = matvec.row_params(s_ptr, z_ptr, rows, rm, DIM, True, GS)
        sc_u, z_u = matvec.row_params(s_ptr, z_ptr, rows + INTER, rm, DIM, True, GS)
        common.wait_previous(PDL, False)
        acc_g, acc_u, ss, vz = matvec.k_loop(pre, w_ptr, s_ptr, z_ptr, row0, row0 + INTER, INTER, x_ptr, nw_ptr, 0,
                                              DIM, DIM, BLOCK_R, BLOCK_K, VW, True, GS, True, True, STAGES, PDL, False)
        inv = 1.0 / tl.sqrt(tl.sum(ss, 0) / DIM + eps)
        g = common.round_to(matvec.row_scale(matvec.row_totals(acc_g, vz, z_g, DIM, BLOCK_R, True, GS), sc_g, DIM, True, GS)
                        * inv, dtype)
        u = common.round_to(matvec.row_scale(matvec.row_totals(acc_u, vz, z_u, DIM, BLOCK_R, True, GS), sc_u, DIM, True, GS)
                        * inv, dtype)
        act = common.round_to(g / (1.0 + tl.exp(-g)), dtype)
        tl.store(h_ptr + rows, (act * u).to(dtype), mask=rm)


@triton.jit
def _words_even(w_ptr, row0, row02, k0, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    quad = tl.arange(0, BLOCK_R // 4)[None, :, None]
    lane = tl.arange(0, 4)[None, None, :]
    kw3 = (k0 // 8 + tl.arange(0, BLOCK_K // 8))[:, None, None]
    words = tl.load(w_ptr + ((row0 // 4 + quad) * (K // 8) + kw3) * 4 + lane)
    words2 = tl.load(w_ptr + ((row02 // 4 + quad) * (K // 8) + kw3) * 4 + lane)
    return words, words2


@triton.jit
def _mac_lean(acc, acc2, ss, vz, words, words2, v_ptr, g_ptr, u_ptr, k0, BLOCK_K: tl.constexpr, UVEC: tl.constexpr):
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    if UVEC:  # the scaled inputs come computed (a stand-in for work done once a step)
        vj = matvec.eight_columns(tl.load(u_ptr + kw[:, None] * 8 + tl.arange(0, 8)[None, :]))
        acc, acc2 = matvec.nibble_mac(acc, acc2, words, words2, vj, False, True)
    else:
        vj = matvec.vec8(v_ptr, g_ptr, kw, kw >= 0, ss, True)
        ss = vj[8]
        vsum = vj[0] + vj[1] + vj[2] + vj[3] + vj[4] + vj[5] + vj[6] + vj[7]
        acc, acc2 = matvec.nibble_mac(acc, acc2, words, words2, vj, True, True)
        vz += vsum
    return acc, acc2, ss, vz


@triton.jit
def _l2_prefetch(w_ptr, word0, NBYTES: tl.constexpr):
    """cp.async.bulk.prefetch.L2 of NBYTES from int32 word word0 of w_ptr, in 32 slices."""
    t = tl.arange(0, 32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                              [w_ptr + word0 + t * (NBYTES // 128), tl.full([32], NBYTES // 32, tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _probe_lean(x_ptr, nw_ptr, w_ptr, s_ptr, z_ptr, h_ptr, u_ptr, eps, DIM: tl.constexpr, INTER: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, UVEC: tl.constexpr, ROWMOD: tl.constexpr,
                STAGES: tl.constexpr = 0, PREF: tl.constexpr = 0, PDL: tl.constexpr = False):
    """The 4-bit gate/up kernel with unmasked loads (whole blocks only): the next block's words
    prefetched into registers (STAGES 0) or through Triton's pipelining (STAGES > 0); UVEC: the
    scaled inputs read from u_ptr instead of computed; PREF: the program's weights prefetched into
    L2 before the wait."""
    pid = tl.program_id(0)
    if ROWMOD > 0:
        pid = pid % ROWMOD
    row0 = pid * BLOCK_R
    rows = row0 + tl.arange(0, BLOCK_R)
    dtype = x_ptr.dtype.element_ty
    if STAGES == 0:
        pre = _words_even(w_ptr, row0, row0 + INTER, 0, DIM, BLOCK_R, BLOCK_K)
    sc_g, z_g = matvec.row_params(s_ptr, z_ptr, rows, rows >= 0, DIM, True, DIM)
    sc_u, z_u = matvec.row_params(s_ptr, z_ptr, rows + INTER, rows >= 0, DIM, True, DIM)
    if PREF:  # the program's weights into L2 before the wait (a slice of each half a thread)
        _l2_prefetch(w_ptr, row0 // 4 * (DIM // 2), BLOCK_R * DIM // 2)
        _l2_prefetch(w_ptr, (row0 + INTER) // 4 * (DIM // 2), BLOCK_R * DIM // 2)
    common.wait_previous(PDL, False)
    acc = tl.zeros([BLOCK_K // 8, BLOCK_R // 4, 4], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_K // 8, BLOCK_R // 4, 4], dtype=tl.float32)
    ss = tl.zeros([BLOCK_K // 8], dtype=tl.float32)
    vz = tl.zeros([BLOCK_K // 8], dtype=tl.float32)
    if STAGES > 0:  # the weights through Triton's pipelining (asynchronous copies to shared memory)
        for i in tl.range(0, DIM, BLOCK_K, num_stages=STAGES):
            cur = _words_even(w_ptr, row0, row0 + INTER, i, DIM, BLOCK_R, BLOCK_K)
            acc, acc2, ss, vz = _mac_lean(acc, acc2, ss, vz, cur[0], cur[1], x_ptr, nw_ptr, u_ptr, i, BLOCK_K, UVEC)
    else:
        for i in tl.range(0, DIM, BLOCK_K, num_stages=1):
            nxt = _words_even(w_ptr, row0, row0 + INTER, (i + BLOCK_K) % DIM, DIM, BLOCK_R, BLOCK_K)
            acc, acc2, ss, vz = _mac_lean(acc, acc2, ss, vz, pre[0], pre[1], x_ptr, nw_ptr, u_ptr, i, BLOCK_K, UVEC)
            pre = nxt
    common.let_next(PDL)
    if UVEC:
        ss = tl.load(u_ptr + DIM + tl.arange(0, BLOCK_K // 8)) * 0.0 + 1.0
        vz = ss
    inv = 1.0 / tl.sqrt(tl.sum(ss, 0) / DIM + eps)
    g = common.round_to(matvec.row_scale(matvec.row_totals(acc, vz, z_g, DIM, BLOCK_R, True, DIM), sc_g, DIM, True, DIM)
                    * inv, dtype)
    u = common.round_to(matvec.row_scale(matvec.row_totals(acc2, vz, z_u, DIM, BLOCK_R, True, DIM), sc_u, DIM, True, DIM)
                    * inv, dtype)
    act = common.round_to(g / (1.0 + tl.exp(-g)), dtype)
    tl.store(h_ptr + rows, (act * u).to(dtype))


@triton.jit
def _mac1(acc, vz, words, v_ptr, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """`_mac` for one one-group 4-bit weight without a gain (down, o)."""
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    vj = matvec.vec8(v_ptr, v_ptr, kw, kw < K // 8, vz, False)
    vsum = vj[0] + vj[1] + vj[2] + vj[3] + vj[4] + vj[5] + vj[6] + vj[7]
    acc, _ = matvec.nibble_mac(acc, acc, words, words, vj, True, False)
    return acc, vz + vsum


@triton.jit
def _probe_gemv(y_ptr, w_ptr, s_ptr, z_ptr, x_ptr, out_ptr, part_ptr, cnt_ptr, N: tl.constexpr, K: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr,
                KS: tl.constexpr, MODE: tl.constexpr, PDL: tl.constexpr = False):
    """down as `_gemv` (residual, split-K) with the weights through Triton's pipelining; MODE 1:
    loads only."""
    blk = tl.program_id(0)
    row0 = blk * BLOCK_R
    rows = row0 + tl.arange(0, BLOCK_R)
    rm = rows < N
    k_lo = tl.program_id(1) * KS
    scale, zero = matvec.row_params(s_ptr, z_ptr, rows, rm, K, True, K)
    common.wait_previous(PDL, False)
    res = tl.load(x_ptr + rows).to(tl.float32)
    quad = tl.arange(0, BLOCK_R // 4)[None, :, None]
    lane = tl.arange(0, 4)[None, None, :]
    acc = tl.zeros([BLOCK_K // 8, BLOCK_R // 4, 4], dtype=tl.float32)
    iacc = tl.zeros([BLOCK_K // 8, BLOCK_R // 4, 4], dtype=tl.int32)
    vz = tl.zeros([BLOCK_K // 8], dtype=tl.float32)
    for i in tl.range(0, KS, BLOCK_K, num_stages=STAGES):
        kw3 = ((k_lo + i) // 8 + tl.arange(0, BLOCK_K // 8))[:, None, None]
        words = tl.load(w_ptr + ((row0 // 4 + quad) * (K // 8) + kw3) * 4 + lane, mask=kw3 < K // 8, other=0)
        if MODE == 1:
            iacc = iacc ^ words
        else:
            acc, vz = _mac1(acc, vz, words, y_ptr, k_lo + i, K, BLOCK_K)
    common.let_next(PDL)
    if MODE == 1:
        t = tl.reshape(tl.xor_sum(iacc, 0), [BLOCK_R]).to(tl.float32)
    else:
        t = matvec.row_totals(acc, vz, zero, K, BLOCK_R, True, K)
    if SPLIT == 1:
        matvec.gemv_out(t, scale, res, out_ptr, rows, rm, K, True, True, K, y_ptr.dtype.element_ty)
    else:
        r = tl.arange(0, BLOCK_R)
        tl.store(part_ptr + (blk * SPLIT + tl.program_id(1)) * BLOCK_R + r, t)
        if common.arrive_last(cnt_ptr + blk, SPLIT):
            t = common.sum_parts(part_ptr + blk * SPLIT * BLOCK_R, r, BLOCK_R, SPLIT)
            matvec.gemv_out(t, scale, res, out_ptr, rows, rm, K, True, True, K, y_ptr.dtype.element_ty)
            tl.store(cnt_ptr + blk, 0)


def down_probe(args, dev, before=None) -> dict:
    """Graphs of down launches: the decode kernel (`gemv`) at `--down-current` shapes, the
    pipelined probe at `--down` shapes (full and loads only)."""
    n, k = 3584, 18944
    words = [torch.randint(-2**31, 2**31 - 1, (n // 4, k // 8, 4), dtype=torch.int32, device=dev)
             for _ in range(args.layers)]
    scales = torch.rand(n, 1, device=dev) * 1e-3
    zeros = torch.full((n, 1), 8.0, device=dev)
    y = torch.randn(k, dtype=torch.bfloat16, device=dev)
    x = torch.randn(n, dtype=torch.bfloat16, device=dev)
    scratch = common.SplitScratch(dev, n * 16, n)
    wt = [common.Weight(w, scales, zeros, k) for w in words]
    graphs = {}
    for shape in [tuple(int(v) for v in t.split(",")) for t in args.down_current.split(";") if t]:
        r, bk, w, st, sp = shape
        def launch(i, r=r, bk=bk, w=w, st=st, sp=sp):
            if before:
                before(i)
            matvec.gemv(wt[i], y, x, x, rows=r, block_k=bk, warps=w, stages=st, split=sp, scratch=scratch, pdl=True)
        graphs[("down kernel", shape, n, 0)] = graph_of(launch, args.layers)
    for shape in [tuple(int(v) for v in t.split(",")) for t in args.down.split(";") if t]:
        r, bk, w, st, sp = shape
        sp, ks = common.split_k(k, bk, sp)
        for mode in (0, 1):
            def launch(i, r=r, bk=bk, w=w, st=st, sp=sp, ks=ks, mode=mode):
                if before:
                    before(i)
                _probe_gemv[(n // r, sp)](y, *wt[i].args(), x, x, scratch.part, scratch.count, N=n, K=k, BLOCK_R=r,
                                          BLOCK_K=bk, STAGES=st, SPLIT=sp, KS=ks, MODE=mode, PDL=True, num_warps=w,
                                          launch_pdl=True)
            graphs[(f"down {'loads' if mode else 'pipe'}", shape, n, 0)] = graph_of(launch, args.layers)
    return graphs


_KEEP = []  # the launch closures, and with them the tensors that the graphs read


def graph_of(launch, n: int):
    _KEEP.append(launch)
    launch(0)  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            for i in range(n):
                launch(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return g


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--row-blocks", type=int, default=16)
    ap.add_argument("--shapes", default="8,512,2,2", help="rows,block_k,warps,stages;...")
    ap.add_argument("--inter", default="18944", help="rows of gate (and of up) to time, e.g. 8448,16896,18944")
    ap.add_argument("--maxnreg", default="0", help="register limits to try (0: Triton's choice)")
    ap.add_argument("--modes", default="kernel,loads,L2")
    ap.add_argument("--down-current", default="", help="rows,block_k,warps,stages,split;... of the decode kernel")
    ap.add_argument("--down", default="", help="rows,block_k,warps,stages,split;... of `_probe_gemv`")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--l2", action="store_true", help="lean shapes also with the weights in L2")
    ap.add_argument("--chain", action="store_true",
                    help="gate/up launches each after an o projection, down launches each after gate/up")
    ap.add_argument("--lean", default="", help="rows,block_k,warps,uvec[,stages];... of `_probe_lean` (DRAM, L2)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    dim, inter = 3584, 18944
    torch.manual_seed(0)
    most = max([inter] + [int(v) for v in args.inter.split(",")])
    words = [torch.randint(-2**31, 2**31 - 1, (2 * most // 4, dim // 8, 4), dtype=torch.int32, device=dev)
             for _ in range(args.layers)]
    scales = torch.rand(2 * most, 1, device=dev) * 1e-3
    zeros = torch.full((2 * most, 1), 8.0, device=dev)
    dense = [torch.randn(2 * inter, dim, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(min(args.layers, 8))]
    x = torch.randn(dim, dtype=torch.bfloat16, device=dev)
    nw = torch.ones(dim, dtype=torch.bfloat16, device=dev)
    h = torch.empty(most, dtype=torch.bfloat16, device=dev)
    q4_bytes = 2 * inter * (dim // 2 + 8)
    print(f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(dev).multi_processor_count} SMs; "
          f"gate/up 4-bit {q4_bytes / 1e6:.1f} MB, bf16 {dense[0].numel() * 2 / 1e6:.1f} MB a layer")

    def q4_launch(shape, mode, rowmod, rows, nreg):
        r, k, w, st = shape
        extra = {"maxnreg": nreg} if nreg else {}

        def launch(i):
            _probe[(triton.cdiv(rows, r),)](x, nw, words[i], scales, zeros, h, 1e-6, DIM=dim, INTER=rows, GS=dim,
                                            BLOCK_R=r, BLOCK_K=k, VW=k // 8, STAGES=st, MODE=mode, ROWMOD=rowmod,
                                            PDL=True, num_warps=w, launch_pdl=True, **extra)
        return launch

    def bf16_launch(shape):
        r, k, w, st = shape

        def launch(i):
            decode.rms_gate_up[(triton.cdiv(inter, r),)](x, nw, dense[i % len(dense)], dense[i % len(dense)],
                                                          dense[i % len(dense)], h, 1e-6, DIM=dim, INTER=inter,
                                                          Q4=False, GS=dim, BLOCK_R=r, BLOCK_K=k, VW=k, STAGES=st,
                                                          PDL=True, num_warps=w, launch_pdl=True)
        return launch

    ow = [common.Weight(torch.randint(-2**31, 2**31 - 1, (dim // 4, dim // 8, 4), dtype=torch.int32, device=dev),
                        scales[:dim], zeros[:dim], dim) for _ in range(args.layers)] if args.chain else []
    y = torch.randn(dim, dtype=torch.bfloat16, device=dev)

    def o_launch(i):  # --chain: the o projection before each gate/up launch, as in a decode step
        matvec.gemv(ow[i], y, x, x, rows=8, block_k=1024, warps=4, stages=2, split=1, pdl=True)

    def current_launch(shape):
        r, k, w, st = shape
        wt = [common.Weight(wd[: 2 * inter // 4], scales[: 2 * inter], zeros[: 2 * inter], dim) for wd in words]

        def launch(i):
            if args.chain:
                o_launch(i)
            decode.rms_gate_up[(triton.cdiv(inter, r),)](x, nw, *wt[i].args(), h, 1e-6, DIM=dim, INTER=inter,
                                                          Q4=True, GS=dim, BLOCK_R=r, BLOCK_K=k, VW=k // 8, STAGES=st,
                                                          PDL=True, num_warps=w, launch_pdl=True)
        return launch

    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";") if s]
    graphs = {}
    graphs = {("bf16 kernel", (4, 256, 4, 1), inter, 0): graph_of(bf16_launch((4, 256, 4, 1)), args.layers)}
    gu = [common.Weight(wd[: 2 * inter // 4], scales[: 2 * inter], zeros[: 2 * inter], dim) for wd in words]

    def gu_launch(i):  # --chain: gate/up before each down launch
        decode.rms_gate_up[(inter // 8,)](x, nw, *gu[i].args(), h, 1e-6, DIM=dim, INTER=inter, Q4=True, GS=dim,
                                           BLOCK_R=8, BLOCK_K=512, VW=64, STAGES=2, PDL=True, num_warps=2,
                                           launch_pdl=True)
    graphs.update(down_probe(args, dev, gu_launch if args.chain else None))
    modes = args.modes.split(",")
    for shape in shapes:
        if "kernel" in modes:
            graphs[("q4 kernel", shape, inter, 0)] = graph_of(current_launch(shape), args.layers)
        for rows in (int(v) for v in args.inter.split(",")):
            for nreg in (int(v) for v in args.maxnreg.split(",")):
                for mode in modes:
                    if mode != "kernel":
                        launch = q4_launch(shape, {"full": 0, "loads": 1, "L2": 0}[mode],
                                           args.row_blocks if mode == "L2" else 0, rows, nreg)
                        graphs[(f"q4 {mode}", shape, rows, nreg)] = graph_of(launch, args.layers)
    u = torch.randn(dim + 64, device=dev)
    for lean in [tuple(int(v) for v in t.split(",")) for t in args.lean.split(";") if t]:
        r, k, w, uvec, st, pref = lean + (0,) * (6 - len(lean))
        for rowmod in (0, args.row_blocks) if args.l2 else (0,):
            def launch(i, r=r, k=k, w=w, uvec=uvec, rowmod=rowmod, st=st, pref=pref):
                if args.chain:
                    o_launch(i)
                _probe_lean[(inter // r,)](x, nw, words[i], scales, zeros, h, u, 1e-6, DIM=dim, INTER=inter, BLOCK_R=r,
                                           BLOCK_K=k, UVEC=uvec, ROWMOD=rowmod, STAGES=st, PREF=pref,
                                           PDL=True, num_warps=w, launch_pdl=True)
            label = f"lean{'+u' if uvec else ''}{f' s{st}' if st else ''}{' pf' if pref else ''}{' L2' if rowmod else ''}"
            graphs[(label, (r, k, w), inter, 0)] = graph_of(launch, args.layers)
    if args.lean:  # same sums as the decode kernel, bit for bit
        current_launch((8, 512, 2, 2))(0)
        want = h[:inter].clone()
        h.zero_()
        _probe_lean[(inter // 8,)](x, nw, words[0], scales, zeros, h, u, 1e-6, DIM=dim, INTER=inter, BLOCK_R=8,
                                   BLOCK_K=512, UVEC=0, ROWMOD=0, PDL=False, num_warps=2)
        print(f"lean (8, 512, 2) against the decode kernel: {(h[:inter] != want).sum().item()} of {inter} differ")
    got = {key: [] for key in graphs}
    for _ in range(args.rounds):
        for key, g in graphs.items():
            if args.verbose:
                print("timing", key, flush=True)
            got[key].append(graph_ms(g, args.reps) * 1000 / args.layers)
    for (label, shape, rows, nreg), ts in got.items():
        us = statistics.median(ts)
        nbytes = (dense[0].numel() * 2 if label.startswith("bf16") else 3584 * (18944 // 2 + 8) if label.startswith("down")
                  else q4_bytes * rows / inter)
        print(f"{label:10s} {str(shape):16s} rows {rows:5d} maxnreg {nreg:3d} {us:7.2f} us  {nbytes / us / 1e6:5.2f} TB/s"
              f"  (rounds: {', '.join(f'{t:.2f}' for t in ts)})")


if __name__ == "__main__":
    main()
