"""Matrix-vector products for one-token steps: the K loop (`k_loop`, one K-block at a time in
`_mac`) that the fused decode kernels (decode.py) share, with an RMSNorm's gain folded in and two
outputs from one input where they ask for it, and the GEMV kernel `_gemv` / `gemv` (o_proj and
down_proj into the residual stream, optionally split over K; the LLM's lm_head; the one-row
product of a 4-bit prefill).

Projection weights come as a `Weight` (common.py): a dense matrix, or 4-bit GPTQ values packed
eight to an int32 (the int4 backend's `Q4Linear`, in the layout `_mac` describes), unpacked inside
the same kernels.

Tests: tests/test_kernels.py (dense weights, through the decode step and the LLM's lm_head),
tests/test_int4_kernels.py (`test_split_k_gemv_matches_dequantized`: 4-bit, split K, with and
without Triton's pipelining of the words; the fused 4-bit decode).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .common import SplitScratch, Weight, arrive_last, let_next, round_to, sum_parts, wait_previous, split_k


@triton.jit
def vec(v_ptr, g_ptr, cols, cm, ss, GAIN: tl.constexpr):
    """Inputs v[cols] in float32; under GAIN, g * v (an RMSNorm's gain) and ss += v^2 (its scale)."""
    v = tl.load(v_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    if GAIN:
        ss += v * v
        v = v * tl.load(g_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    return v, ss


@triton.jit
def vec8(v_ptr, g_ptr, kw, km, ss, GAIN: tl.constexpr):
    """`vec` for the inputs of 4-bit words kw, in one 16-byte load per word: (v[8kw], v[8kw+1],
    ..., v[8kw+7]) as eight (words,) vectors, ss (words,) += their squares under GAIN."""
    cols = kw[:, None] * 8 + tl.arange(0, 8)[None, :]
    v = tl.load(v_ptr + cols, mask=km[:, None], other=0.0).to(tl.float32)
    if GAIN:
        ss += tl.sum(v * v, 1)
        v = v * tl.load(g_ptr + cols, mask=km[:, None], other=0.0).to(tl.float32)
    v0, v1, v2, v3, v4, v5, v6, v7 = eight_columns(v)
    return v0, v1, v2, v3, v4, v5, v6, v7, ss


@triton.jit
def eight_columns(v):
    """The columns of v (words, 8) as eight (words,) vectors."""
    even, odd = tl.split(tl.reshape(v, [v.shape[0], 4, 2]))  # (words, 4): j = 0 2 4 6 and 1 3 5 7
    e04, e26 = tl.split(tl.reshape(even, [v.shape[0], 2, 2]))
    o15, o37 = tl.split(tl.reshape(odd, [v.shape[0], 2, 2]))
    v0, v4 = tl.split(e04)
    v2, v6 = tl.split(e26)
    v1, v5 = tl.split(o15)
    v3, v7 = tl.split(o37)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def load_words(w_ptr, row0, row02, LIM, k0, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
               Q4: tl.constexpr, TWO: tl.constexpr):
    """The 4-bit words `_mac` takes for the K-block at k0 (zeros past K): (words, words2), tiles
    (BLOCK_K/8, BLOCK_R/4, 4) of the rows from row0 and (TWO) row02; a placeholder when dense."""
    if Q4:
        quad = tl.arange(0, BLOCK_R // 4)[None, :, None]
        lane = tl.arange(0, 4)[None, None, :]
        kw3 = (k0 // 8 + tl.arange(0, BLOCK_K // 8))[:, None, None]
        mq = (row0 + quad * 4 < LIM) & (kw3 < K // 8)  # whole quads: the words of padding rows exist
        words = tl.load(w_ptr + ((row0 // 4 + quad) * (K // 8) + kw3) * 4 + lane, mask=mq, other=0)
        words2 = words
        if TWO:
            words2 = tl.load(w_ptr + ((row02 // 4 + quad) * (K // 8) + kw3) * 4 + lane, mask=mq, other=0)
    else:
        words = tl.zeros([1], dtype=tl.int32)
        words2 = words
    return words, words2


@triton.jit
def first_block(w_ptr, row0, row02, LIM, k0, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
           Q4: tl.constexpr, TWO: tl.constexpr, PIPE: tl.constexpr):
    """`load_words` of the first K-block, which `k_loop` takes as `pre`; none (a placeholder) under PIPE."""
    if PIPE:
        words = tl.zeros([1], dtype=tl.int32)
        pre = (words, words)
    else:
        pre = load_words(w_ptr, row0, row02, LIM, k0, K, BLOCK_R, BLOCK_K, Q4, TWO)
    return pre


@triton.jit
def nibble_mac(acc, acc2, words, words2, vj, SCALE: tl.constexpr, TWO: tl.constexpr):
    """`_mac`'s one-group step: the eight 4-bit values of words (`pair_nibbles` order: nibble j
    holds value 2j for j < 4, 2j - 7 above), each masked in place as a float32 denormal, times
    their inputs vj into acc, and under TWO those of words2 into acc2. SCALE: vj are the inputs,
    scaled here by 2^(100 - shift) of their nibble (see `_mac`); else they come scaled."""
    high = words >> 16  # nibbles 6 and 7 from bits 8..15: bits 24.. of a float32 are its exponent
    high2 = words2 >> 16
    for j in tl.static_range(8):
        if j < 6:
            sh = 4 * j
            src = words
            src2 = words2
        else:
            sh = 4 * j - 16
            src = high
            src2 = high2
        vs = vj[2 * j if j < 4 else 2 * j - 7]
        if SCALE:
            vs = vs * (1267650600228229401496703205376.0 / (1 << sh))
        vs = vs[:, None, None]
        acc += (src & (0xF << sh)).to(tl.float32, bitcast=True) * vs
        if TWO:
            acc2 += (src2 & (0xF << sh)).to(tl.float32, bitcast=True) * vs
    return acc, acc2


@triton.jit
def _mac(acc, acc2, ss, vz, pre, w_ptr, s_ptr, z_ptr, row0, row02, LIM, v_ptr, g_ptr, k0, K: tl.constexpr,
         BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, Q4: tl.constexpr, GS: tl.constexpr, GAIN: tl.constexpr,
         TWO: tl.constexpr):
    """One K-block of matrix-vector products: acc += W[rows, block] * v'[block] elementwise for
    rows = row0 + 0..BLOCK_R-1 (those below LIM; with TWO, acc2 the same for rows from row02, for
    the kernels that make two outputs from one input: the halves of a rotated head, gate and up),
    with v' = g * v under GAIN (an RMSNorm's gain; then ss += v^2 for its scale), else v; with
    one-group 4-bit W, vz += the sum of v' (for the zero point, see below).

    Dense W (N, K): acc (BLOCK_R, BLOCK_K), ss (BLOCK_K,). 4-bit W (`Weight`): values packed eight
    to an int32 along K (value j of a word in nibble j/2 for even j, 4 + j//2 for odd j:
    backends/gptq.py `pair_nibbles`), the words of four
    consecutive rows interleaved, (N/4, K/8, 4), so that one 16-byte load brings a word of each of
    four rows; acc (BLOCK_K/8, BLOCK_R/4, 4), ss (BLOCK_K/8,): the eight values of a word add into
    one element (`row_totals` sums up the rows); their words come loaded, `pre` (`load_words`: the
    kernels load the next block's while this one is computed). With groups the zero point and
    scale are applied here; with one group `row_totals` takes the zero point's share off each row's
    total and `row_scale` applies the scale, once per output."""
    if Q4:
        # tile (words, quads, 4 rows): the order makes Triton give each thread whole columns
        # (every row of the block for its words, so the inputs are loaded and scaled once per
        # thread) and 16-byte loads
        quad = tl.arange(0, BLOCK_R // 4)[None, :, None]
        lane = tl.arange(0, 4)[None, None, :]
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        km = kw < K // 8
        kw3 = kw[:, None, None]
        mr = row0 + quad * 4 + lane < LIM  # (1, quads, 4): rows
        words, words2 = pre
        r3 = row0 + quad * 4 + lane
        r3b = row02 + quad * 4 + lane
        if GS == K:
            # One group: a value's 4 bits masked in place (value j at bits 4j.., or 4j-16.. of the
            # word shifted by 16 for j >= 6) are, as a float32, the denormal q * 2^(sh-149)
            # (patterns below 2^24 read as their integer times 2^-149), so one AND makes the
            # weight and v * 2^(100-sh) turns the product into q * v * 2^-49, exactly (no FTZ:
            # the GPU's FMA keeps denormals). The zero point comes off the row's total, z * sum(v)
            # * 2^-49 (`row_totals`, sum(v) from vz); `row_scale` applies 2^49 with the row's scale.
            vj = vec8(v_ptr, g_ptr, kw, km, ss, GAIN)
            ss = vj[8]
            vsum = vj[0] + vj[1] + vj[2] + vj[3] + vj[4] + vj[5] + vj[6] + vj[7]
            acc, acc2 = nibble_mac(acc, acc2, words, words2, vj, True, TWO)
            vz += vsum
        else:
            # groups: zero point and scale per row and word (a word's eight values share a group)
            grp = r3 * (K // GS) + kw3 * 8 // GS
            grp2 = r3b * (K // GS) + kw3 * 8 // GS
            m = mr & (kw3 < K // 8)
            zero = 8388608.0 + tl.load(z_ptr + grp, mask=m, other=0.0)
            scale = tl.load(s_ptr + grp, mask=m, other=0.0)
            zero2 = 8388608.0 + tl.load(z_ptr + grp2, mask=m, other=0.0)
            scale2 = tl.load(s_ptr + grp2, mask=m, other=0.0)
            for j in tl.static_range(8):  # nibble j: value 2j (j < 4) or 2j - 7
                v, ss = vec(v_ptr, g_ptr, kw * 8 + (2 * j if j < 4 else 2 * j - 7), km, ss, GAIN)
                # q with the bits of 2^23 is the float 2^23 + q: minus (2^23 + z) gives q - z
                w = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zero
                acc += w * scale * v[:, None, None]
                if TWO:
                    w2 = (((words2 >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zero2
                    acc2 += w2 * scale2 * v[:, None, None]
    else:
        cols = k0 + tl.arange(0, BLOCK_K)
        v, ss = vec(v_ptr, g_ptr, cols, cols < K, ss, GAIN)
        acc = dense_mac(acc, dense_tile(w_ptr, row0, row0, LIM, k0, K, BLOCK_R, BLOCK_K), v)
        if TWO:
            acc2 = dense_mac(acc2, dense_tile(w_ptr, row02, row0, LIM, k0, K, BLOCK_R, BLOCK_K), v)
    return acc, acc2, ss, vz


@triton.jit
def dense_tile(w_ptr, row0, mrow0, LIM, k0, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Dense W[row0.., k0..] (N, K): a (BLOCK_R, BLOCK_K) tile, zeros past K and where row
    mrow0 + i is not below LIM (the kernels that take two tiles mask both by the first's rows)."""
    rows = row0 + tl.arange(0, BLOCK_R)
    cols = k0 + tl.arange(0, BLOCK_K)
    m = (mrow0 + tl.arange(0, BLOCK_R) < LIM)[:, None] & (cols < K)[None, :]
    return tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=m, other=0.0)


@triton.jit
def dense_mac(acc, w, v):
    """One dense K-block: acc += w * v elementwise (float32), v the block's inputs. The batched
    kernels (batch.py) apply a tile to each row through this too: their rows' sums are the same."""
    return acc + w.to(tl.float32) * v[None, :]


@triton.jit
def _acc(BLOCK_R: tl.constexpr, VW: tl.constexpr, Q4: tl.constexpr):
    """Zeroed accumulators for `_mac`."""
    if Q4:
        a = tl.zeros([VW, BLOCK_R // 4, 4], dtype=tl.float32)
    else:
        a = tl.zeros([BLOCK_R, VW], dtype=tl.float32)
    return a


@triton.jit
def k_loop(pre, w_ptr, s_ptr, z_ptr, row0, row02, LIM, v_ptr, g_ptr, k_lo, K: tl.constexpr, KS: tl.constexpr,
            BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, VW: tl.constexpr, Q4: tl.constexpr, GS: tl.constexpr,
            GAIN: tl.constexpr, TWO: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr, PIPE: tl.constexpr):
    """`_mac` over inputs k_lo..k_lo+KS in K-blocks -> (acc, acc2, ss, vz), the kernels' main loop.
    `pre`: the first block's words (`first_block`), which the kernel loads before `wait_previous`; each
    next block's are loaded while one is computed. PIPE: the 4-bit words too go through Triton's
    pipelining (STAGES K-blocks in flight, asynchronous copies through shared memory; no `pre`).
    Under PDL the next kernel may start after the loop."""
    acc = _acc(BLOCK_R, VW, Q4)
    acc2 = acc
    if TWO:
        acc2 = _acc(BLOCK_R, VW, Q4)
    ss = tl.zeros([VW], dtype=tl.float32)
    vz = tl.zeros([VW], dtype=tl.float32)
    for i in tl.range(0, KS, BLOCK_K, num_stages=STAGES):
        k0 = k_lo + i
        if PIPE:
            cur = load_words(w_ptr, row0, row02, LIM, k0, K, BLOCK_R, BLOCK_K, Q4, TWO)
        else:
            cur = pre
            pre = load_words(w_ptr, row0, row02, LIM, k0 + BLOCK_K, K, BLOCK_R, BLOCK_K, Q4, TWO)
        acc, acc2, ss, vz = _mac(acc, acc2, ss, vz, cur, w_ptr, s_ptr, z_ptr, row0, row02, LIM, v_ptr, g_ptr, k0, K,
                                 BLOCK_R, BLOCK_K, Q4, GS, GAIN, TWO)
    let_next(PDL)
    return acc, acc2, ss, vz


@triton.jit
def row_params(s_ptr, z_ptr, rows, rmask, K: tl.constexpr, Q4: tl.constexpr, GS: tl.constexpr):
    """(scale * 2^49, zero point) of rows of a one-group 4-bit weight for `row_totals` and `row_scale`
    (placeholders otherwise). Weights: the kernels load them before `wait_previous`, so that they
    are not a memory round trip at the end of every program."""
    scale = 1.0
    zero = 0.0
    if Q4:
        if GS == K:
            scale = tl.load(s_ptr + rows, mask=rmask, other=0.0) * 562949953421312.0
            zero = tl.load(z_ptr + rows, mask=rmask, other=0.0)
    return scale, zero


@triton.jit
def row_totals(acc, vz, zero, K: tl.constexpr, BLOCK_R: tl.constexpr, Q4: tl.constexpr, GS: tl.constexpr):
    """`_mac`'s accumulators summed per row: (BLOCK_R,), row0 first; for a one-group 4-bit weight
    minus the zero point's share, z * sum(v) * 2^-49 (see `_mac`; zero from `row_params`)."""
    if Q4:
        t = tl.reshape(tl.sum(acc, 0), [BLOCK_R])
        if GS == K:
            t -= zero * (tl.sum(vz, 0) * 1.7763568394002505e-15)  # 2^-49
    else:
        t = tl.sum(acc, 1)
    return t


@triton.jit
def row_scale(y, scale, K: tl.constexpr, Q4: tl.constexpr, GS: tl.constexpr):
    """The per-row scale of a one-group 4-bit weight (from `row_params`, times 2^49, see `_mac`),
    applied to the finished row sums."""
    if Q4:
        if GS == K:
            y = y * scale
    return y


@triton.jit
def _gemv(y_ptr, w_ptr, s_ptr, z_ptr, x_ptr, out_ptr, part_ptr, cnt_ptr, N: tl.constexpr, K: tl.constexpr,
          RESIDUAL: tl.constexpr, Q4: tl.constexpr, GS: tl.constexpr, BLOCK_R: tl.constexpr,
          BLOCK_K: tl.constexpr, VW: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr, KS: tl.constexpr,
          PDL: tl.constexpr = False, PIPE: tl.constexpr = False):
    """out[rows] = W[rows] @ y, rounded to y's dtype as `linear(y)` is, plus x[rows] (rounded like
    `x + linear(y)`) when RESIDUAL; out may be x itself (each row block has one writer).

    SPLIT > 1 (split-K, for a long K and few rows): program (i, s) takes inputs s*KS.. of row block
    i and leaves its sums in `part`; the block's last program to finish (counted with an atomic,
    reset for the next call) adds them up in a fixed order and writes the rows."""
    blk = tl.program_id(0)
    row0 = blk * BLOCK_R
    rows = row0 + tl.arange(0, BLOCK_R)
    rm = rows < N
    k_lo = tl.program_id(1) * KS  # (0 without a split)
    scale, zero = row_params(s_ptr, z_ptr, rows, rm, K, Q4, GS)
    pre = first_block(w_ptr, row0, row0, N, k_lo, K, BLOCK_R, BLOCK_K, Q4, False, PIPE)
    wait_previous(PDL, False)  # (`k_loop` lets the next kernel in after the loop)
    res = 0.0
    if RESIDUAL:  # read now, not at the end of the program
        res = tl.load(x_ptr + rows, mask=rm, other=0.0).to(tl.float32)
    acc, _, _, vz = k_loop(pre, w_ptr, s_ptr, z_ptr, row0, row0, N, y_ptr, y_ptr, k_lo, K, KS, BLOCK_R, BLOCK_K, VW,
                            Q4, GS, False, False, STAGES, PDL, PIPE)
    t = row_totals(acc, vz, zero, K, BLOCK_R, Q4, GS)  # row sums over this program's inputs, before the scale
    if SPLIT == 1:
        gemv_out(t, scale, res, out_ptr, rows, rm, K, RESIDUAL, Q4, GS, y_ptr.dtype.element_ty)
    else:
        r = tl.arange(0, BLOCK_R)
        tl.store(part_ptr + (blk * SPLIT + tl.program_id(1)) * BLOCK_R + r, t)
        if arrive_last(cnt_ptr + blk, SPLIT):
            t = sum_parts(part_ptr + blk * SPLIT * BLOCK_R, r, BLOCK_R, SPLIT)
            gemv_out(t, scale, res, out_ptr, rows, rm, K, RESIDUAL, Q4, GS, y_ptr.dtype.element_ty)
            tl.store(cnt_ptr + blk, 0)


@triton.jit
def gemv_out(t, scale, res, out_ptr, rows, rm, K: tl.constexpr, RESIDUAL: tl.constexpr, Q4: tl.constexpr,
              GS: tl.constexpr, dtype: tl.constexpr):
    """`_gemv`'s rows from their sums t: scale, rounding, residual (res, float32)."""
    o = round_to(row_scale(t, scale, K, Q4, GS), dtype)
    if RESIDUAL:
        o = round_to(res + o, dtype)
    tl.store(out_ptr + rows, o.to(out_ptr.dtype.element_ty), mask=rm)


def gemv(w: Weight, y: Tensor, out: Tensor, residual: Tensor | None = None, *, rows: int = 4,
         block_k: int = 512, warps: int = 4, stages: int = 1, split: int = 1,
         scratch: SplitScratch | None = None, pdl: bool = False, pipe: bool = False) -> Tensor:
    """out = W @ y (+ residual) for y (K,); out may be residual (in place). `stages` > 1 pipelines
    the loads of that many K-blocks (asynchronous copies through shared memory): of the inputs, and
    with `pipe` of 4-bit words too (else the next block's words are loaded into registers while one
    is computed, the first before `wait_previous`); `split` > 1 shares
    K out over that many programs per row block (sums in `scratch`, which grows to fit); `pdl`:
    launched as a programmatic dependent of the previous kernel (see `wait_previous`)."""
    x = residual if residual is not None else out
    split, ks = split_k(w.k, w.block_k(block_k), split)
    blocks = triton.cdiv(w.n, rows)
    if split > 1:
        if scratch is None:
            scratch = SplitScratch(y.device)
        scratch.reserve(blocks * split * rows, blocks)
        part, count = scratch.part, scratch.count
    else:
        part = count = out
    _gemv[(blocks, split)](y, *w.args(), x, out, part, count, N=w.n, K=w.k, RESIDUAL=residual is not None,
                           Q4=w.q4, GS=w.group, BLOCK_R=rows, BLOCK_K=w.block_k(block_k), VW=w.vw(block_k),
                           STAGES=stages, SPLIT=split, KS=ks, PDL=pdl, PIPE=pipe, num_warps=warps, launch_pdl=pdl)
    return out
