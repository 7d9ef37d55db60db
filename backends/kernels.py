"""Triton kernels for one-token decode steps: five kernels per layer instead of some eighteen.

A decode step of a small model (the TTS head: 20 layers x 768) is bound by the latency of its
kernels, not by arithmetic or bandwidth, so the layer is fused into five launches:

1. `_rms_qkv_rope`: RMSNorm of the residual stream, the fused q/k/v projection (+ bias), rotary
   embedding at the current position, q to a scratch buffer and k/v straight into the KV cache;
2. `_attend`: single-query attention over cache slots 0..pos (the position is read on the device,
   so one CUDA graph serves every position), masked by per-slot "visible from" positions when given
   (the TTS chunk mask) or causally (the LLM); the slots are split over programs and merged by the
   last one to finish;
3. `_gemv`: o_proj, added to the residual stream in place;
4. `_rms_gate_up`: RMSNorm, the fused gate/up projection and SiLU(gate) * up (for 4-bit
   bfloat16 weights on a GPU, `cuda_gate_up`: the same in CUDA C on the tensor cores, which
   Triton's code generation could not match, backends/q4_decode.cu);
5. `_gemv` again: down_proj, added to the residual stream.

`_gemv` also serves the LLM's lm_head, and `_sample_codes` the TTS step's code choice.

Projection weights come as a `Weight`: a dense matrix, or 4-bit GPTQ values packed eight to an
int32 (the int4 backend's `Q4Linear`), unpacked inside the same kernels (`_mac`); prefills with 4-bit
weights run `q4_mm` (a tensor-core product, up to 512 tokens) or dequantize slices for cuBLAS
(`q4_linear`). On Hopper and later GPUs the step's kernels launch as programmatic dependents
(`_wait_previous`).

Arithmetic is float32 inside a kernel; results are rounded to the model dtype where the eager code
rounds them (after each projection, around the rotary products, after the activation). The RMSNorm
before a projection is folded into it (the normalised input is not rounded on its own), so in bf16
the kernels differ from `minicpm_cli.models.transformer` by about its own rounding error; in float32
by summation order only. This module is imported only when a CUDA runner is built (it needs
Triton); under `TRITON_INTERPRET=1` the same kernels run on the CPU (the tests).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from minicpm_cli.models.transformer import Decoder


@triton.jit
def _wait_previous(PDL: tl.constexpr):
    """Under programmatic dependent launch (PDL, Hopper and later: a kernel of the step may start
    while the previous one finishes): wait until the previous kernel has finished and its writes
    are visible. Before this a kernel may only read what no kernel of the step writes (weights)."""
    if PDL:
        gdc_wait()


@triton.jit
def _let_next(PDL: tl.constexpr):
    """Under PDL: once every program of this kernel has come here, the next kernel may start (its
    programs load their first weights, then wait in `_wait_previous`)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _arrive_last(cnt_ptr, n):
    """Split-K: after this program's partial results are stored, count it in at cnt_ptr; True for
    the last of the n programs to arrive, which then merges the partials and resets the count."""
    tl.debug_barrier()  # every thread's partials are written before the count goes up
    return tl.atomic_add(cnt_ptr, 1, sem="acq_rel") == n - 1


@triton.jit
def _sum_parts(part_ptr, offs, SIZE: tl.constexpr, SPLIT: tl.constexpr):
    """Split-K: the SPLIT partial sums stored at part_ptr + j * SIZE + offs, added in a fixed order
    (read past L1: other programs wrote them)."""
    t = tl.load(part_ptr + offs, cache_modifier=".cg")
    for j in tl.static_range(1, SPLIT):
        t += tl.load(part_ptr + j * SIZE + offs, cache_modifier=".cg")
    return t


@triton.jit
def _shifted(words):
    """Words (R, W) shifted by 4p (R, W, 4): values 2p and 2p + 1 (`pair_nibbles` order) in the low
    4 bits of each 16-bit half."""
    return words[:, :, None] >> (tl.arange(0, 4) * 4)[None, None, :]


@triton.jit
def _pairs(words):
    """The 4-bit values of words (R, W) in `pair_nibbles` order as (R, W, 4) int32: element p holds
    values 2p and 2p + 1 in its low and high 16 bits."""
    return _shifted(words) & 0x000F000F


@triton.jit
def _pairs16(words, nz, MAGIC: tl.constexpr, ONE: tl.constexpr, FMA: tl.constexpr):
    """`_pairs` as two 16-bit floats q - z a word (R, W, 4): one LOP3 puts 16-bit MAGIC (the
    pattern of 2^m) over each 4-bit value q, which makes the float 2^m + q exactly, and one paired
    FMA (x * ONE + nz, nz = -(2^m + z) in both halves (R, 1, 1)) leaves q - z, exactly."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; lop3.b32 t, $1, $2, $3, 0xEA; " + FMA + " $0, t, $4, $5; }", "=r,r,r,r,r,r",
        [_shifted(words), tl.full([1, 1, 4], 0x000F000F, tl.int32),
         tl.full([1, 1, 4], MAGIC * 65537, tl.int32), tl.full([1, 1, 4], ONE * 65537, tl.int32), nz],
        dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _rnd(v, dtype: tl.constexpr):
    """Round a float32 value to the model dtype (and back), as an eager op's output would be."""
    return v.to(dtype).to(tl.float32)


@triton.jit
def _zero_scale(s_ptr, z_ptr, rows, rmask, kw, km, K: tl.constexpr, GS: tl.constexpr):
    """2^23 + zero point, and scale, for rows x words kw of a 4-bit weight: per row (rows, 1) with
    one group, else per row and word (rows, words) (a word's eight inputs share a group)."""
    if GS == K:
        zero = tl.load(z_ptr + rows, mask=rmask, other=0.0)[:, None]
        scale = tl.load(s_ptr + rows, mask=rmask, other=0.0)[:, None]
    else:
        grp = rows[:, None] * (K // GS) + (kw * 8 // GS)[None, :]
        m = rmask[:, None] & km[None, :]
        zero = tl.load(z_ptr + grp, mask=m, other=0.0)
        scale = tl.load(s_ptr + grp, mask=m, other=0.0)
    return 8388608.0 + zero, scale


@triton.jit
def _vec(v_ptr, g_ptr, cols, cm, ss, GAIN: tl.constexpr):
    """Inputs v[cols] in float32; under GAIN, g * v (an RMSNorm's gain) and ss += v^2 (its scale)."""
    v = tl.load(v_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    if GAIN:
        ss += v * v
        v = v * tl.load(g_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    return v, ss


@triton.jit
def _vec8(v_ptr, g_ptr, kw, km, ss, GAIN: tl.constexpr):
    """`_vec` for the inputs of 4-bit words kw, in one 16-byte load per word: (v[8kw], v[8kw+1],
    ..., v[8kw+7]) as eight (words,) vectors, ss (words,) += their squares under GAIN."""
    cols = kw[:, None] * 8 + tl.arange(0, 8)[None, :]
    v = tl.load(v_ptr + cols, mask=km[:, None], other=0.0).to(tl.float32)
    if GAIN:
        ss += tl.sum(v * v, 1)
        v = v * tl.load(g_ptr + cols, mask=km[:, None], other=0.0).to(tl.float32)
    v0, v1, v2, v3, v4, v5, v6, v7 = _eight(v)
    return v0, v1, v2, v3, v4, v5, v6, v7, ss


@triton.jit
def _eight(v):
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
def _words(w_ptr, row0, row02, LIM, k0, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
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
def _first(w_ptr, row0, row02, LIM, k0, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
           Q4: tl.constexpr, TWO: tl.constexpr, PIPE: tl.constexpr):
    """`_words` of the first K-block, which `_k_loop` takes as `pre`; none (a placeholder) under PIPE."""
    if PIPE:
        words = tl.zeros([1], dtype=tl.int32)
        pre = (words, words)
    else:
        pre = _words(w_ptr, row0, row02, LIM, k0, K, BLOCK_R, BLOCK_K, Q4, TWO)
    return pre


@triton.jit
def _nibbles(acc, acc2, words, words2, vj, SCALE: tl.constexpr, TWO: tl.constexpr):
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
    one element (`_total` sums up the rows); their words come loaded, `pre` (`_words`: the
    kernels load the next block's while this one is computed). With groups the zero point and
    scale are applied here; with one group `_total` takes the zero point's share off each row's
    total and `_row_scale` applies the scale, once per output."""
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
            # * 2^-49 (`_total`, sum(v) from vz); `_row_scale` applies 2^49 with the row's scale.
            vj = _vec8(v_ptr, g_ptr, kw, km, ss, GAIN)
            ss = vj[8]
            vsum = vj[0] + vj[1] + vj[2] + vj[3] + vj[4] + vj[5] + vj[6] + vj[7]
            acc, acc2 = _nibbles(acc, acc2, words, words2, vj, True, TWO)
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
                v, ss = _vec(v_ptr, g_ptr, kw * 8 + (2 * j if j < 4 else 2 * j - 7), km, ss, GAIN)
                # q with the bits of 2^23 is the float 2^23 + q: minus (2^23 + z) gives q - z
                w = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zero
                acc += w * scale * v[:, None, None]
                if TWO:
                    w2 = (((words2 >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zero2
                    acc2 += w2 * scale2 * v[:, None, None]
    else:
        rows = row0 + tl.arange(0, BLOCK_R)
        m = (rows < LIM)[:, None]
        cols = k0 + tl.arange(0, BLOCK_K)
        cm = cols < K
        v, ss = _vec(v_ptr, g_ptr, cols, cm, ss, GAIN)
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=m & cm[None, :], other=0.0)
        acc += w.to(tl.float32) * v[None, :]
        if TWO:
            rows2 = row02 + tl.arange(0, BLOCK_R)
            w2 = tl.load(w_ptr + rows2[:, None] * K + cols[None, :], mask=m & cm[None, :], other=0.0)
            acc2 += w2.to(tl.float32) * v[None, :]
    return acc, acc2, ss, vz


@triton.jit
def _acc(BLOCK_R: tl.constexpr, VW: tl.constexpr, Q4: tl.constexpr):
    """Zeroed accumulators for `_mac`."""
    if Q4:
        a = tl.zeros([VW, BLOCK_R // 4, 4], dtype=tl.float32)
    else:
        a = tl.zeros([BLOCK_R, VW], dtype=tl.float32)
    return a


@triton.jit
def _k_loop(pre, w_ptr, s_ptr, z_ptr, row0, row02, LIM, v_ptr, g_ptr, k_lo, K: tl.constexpr, KS: tl.constexpr,
            BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, VW: tl.constexpr, Q4: tl.constexpr, GS: tl.constexpr,
            GAIN: tl.constexpr, TWO: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr, PIPE: tl.constexpr):
    """`_mac` over inputs k_lo..k_lo+KS in K-blocks -> (acc, acc2, ss, vz), the kernels' main loop.
    `pre`: the first block's words (`_first`), which the kernel loads before `_wait_previous`; each
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
            cur = _words(w_ptr, row0, row02, LIM, k0, K, BLOCK_R, BLOCK_K, Q4, TWO)
        else:
            cur = pre
            pre = _words(w_ptr, row0, row02, LIM, k0 + BLOCK_K, K, BLOCK_R, BLOCK_K, Q4, TWO)
        acc, acc2, ss, vz = _mac(acc, acc2, ss, vz, cur, w_ptr, s_ptr, z_ptr, row0, row02, LIM, v_ptr, g_ptr, k0, K,
                                 BLOCK_R, BLOCK_K, Q4, GS, GAIN, TWO)
    _let_next(PDL)
    return acc, acc2, ss, vz


@triton.jit
def _row_params(s_ptr, z_ptr, rows, rmask, K: tl.constexpr, Q4: tl.constexpr, GS: tl.constexpr):
    """(scale * 2^49, zero point) of rows of a one-group 4-bit weight for `_total` and `_row_scale`
    (placeholders otherwise). Weights: the kernels load them before `_wait_previous`, so that they
    are not a memory round trip at the end of every program."""
    scale = 1.0
    zero = 0.0
    if Q4:
        if GS == K:
            scale = tl.load(s_ptr + rows, mask=rmask, other=0.0) * 562949953421312.0
            zero = tl.load(z_ptr + rows, mask=rmask, other=0.0)
    return scale, zero


@triton.jit
def _total(acc, vz, zero, K: tl.constexpr, BLOCK_R: tl.constexpr, Q4: tl.constexpr, GS: tl.constexpr):
    """`_mac`'s accumulators summed per row: (BLOCK_R,), row0 first; for a one-group 4-bit weight
    minus the zero point's share, z * sum(v) * 2^-49 (see `_mac`; zero from `_row_params`)."""
    if Q4:
        t = tl.reshape(tl.sum(acc, 0), [BLOCK_R])
        if GS == K:
            t -= zero * (tl.sum(vz, 0) * 1.7763568394002505e-15)  # 2^-49
    else:
        t = tl.sum(acc, 1)
    return t


@triton.jit
def _row_scale(y, scale, K: tl.constexpr, Q4: tl.constexpr, GS: tl.constexpr):
    """The per-row scale of a one-group 4-bit weight (from `_row_params`, times 2^49, see `_mac`),
    applied to the finished row sums."""
    if Q4:
        if GS == K:
            y = y * scale
    return y


@triton.jit
def _rms_qkv_rope(x_ptr, nw_ptr, w_ptr, s_ptr, z_ptr, b_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr,
                  eps, max_len, DIM: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                  HAS_BIAS: tl.constexpr, Q4: tl.constexpr, GS: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_K: tl.constexpr, VW: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False,
                  PIPE: tl.constexpr = False):
    # program (head, j): rows j*BLOCK_R.. of the head's first half and the matching second-half
    # rows, which the rotation pairs up
    head = tl.program_id(0)
    j = tl.program_id(1)
    dtype = x_ptr.dtype.element_ty
    d = j * BLOCK_R + tl.arange(0, BLOCK_R)
    row0 = head * D + j * BLOCK_R
    r1 = row0 + tl.arange(0, BLOCK_R)
    r2 = r1 + D // 2
    every = r1 >= 0
    lim = (HQ + 2 * HKV) * D
    pre = _first(w_ptr, row0, row0 + D // 2, lim, 0, DIM, BLOCK_R, BLOCK_K, Q4, True, PIPE)
    # before the wait: weights, and the position (written before the step's first kernel)
    sc1, z1 = _row_params(s_ptr, z_ptr, r1, every, DIM, Q4, GS)
    sc2, z2 = _row_params(s_ptr, z_ptr, r2, every, DIM, Q4, GS)
    if HAS_BIAS:
        b1 = tl.load(b_ptr + r1).to(tl.float32)
        b2 = tl.load(b_ptr + r2).to(tl.float32)
    pos = tl.load(pos_ptr)
    c = _rnd(tl.load(cos_ptr + pos * D + d), dtype)
    s = _rnd(tl.load(sin_ptr + pos * D + d), dtype)
    _wait_previous(PDL)
    acc1, acc2, ss, vz = _k_loop(pre, w_ptr, s_ptr, z_ptr, row0, row0 + D // 2, lim, x_ptr, nw_ptr, 0, DIM, DIM,
                                 BLOCK_R, BLOCK_K, VW, Q4, GS, True, True, STAGES, PDL, PIPE)
    inv = 1.0 / tl.sqrt(tl.sum(ss, 0) / DIM + eps)
    y1 = _row_scale(_total(acc1, vz, z1, DIM, BLOCK_R, Q4, GS), sc1, DIM, Q4, GS) * inv
    y2 = _row_scale(_total(acc2, vz, z2, DIM, BLOCK_R, Q4, GS), sc2, DIM, Q4, GS) * inv
    if HAS_BIAS:
        y1 += b1
        y2 += b2
    y1 = _rnd(y1, dtype)
    y2 = _rnd(y2, dtype)
    if head < HQ + HKV:  # q and k heads rotate: x * cos + rotate_half(x) * sin
        o1 = _rnd(_rnd(y1 * c, dtype) - _rnd(y2 * s, dtype), dtype)
        o2 = _rnd(_rnd(y2 * c, dtype) + _rnd(y1 * s, dtype), dtype)
    else:
        o1 = y1
        o2 = y2
    if head < HQ:
        base = q_ptr + head * D
    elif head < HQ + HKV:
        base = kc_ptr + ((head - HQ) * max_len + pos) * D
    else:
        base = vc_ptr + ((head - HQ - HKV) * max_len + pos) * D
    tl.store(base + d, o1.to(dtype))
    tl.store(base + d + D // 2, o2.to(dtype))


@triton.jit
def _rms_norm(x_ptr, w_ptr, out_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out = w * rnd(x / rms(x)) for one row x (N,), rounded where `RMSNorm` rounds."""
    _wait_previous(PDL)
    _let_next(PDL)
    i = tl.arange(0, BLOCK)
    m = i < N
    x = tl.load(x_ptr + i, mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    h = _rnd(x * inv, x_ptr.dtype.element_ty)
    y = h * tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: Tensor, norm, out: Tensor, pdl: bool = False) -> Tensor:
    """`norm(x)` (a `RMSNorm`) of one row x (N,) into out, in one launch (the eager module: seven);
    `pdl`: launched as a programmatic dependent of the previous kernel (see `_wait_previous`)."""
    n = x.numel()
    _rms_norm[(1,)](x, norm.weight, out, norm.eps, N=n, BLOCK=triton.next_power_of_2(n), PDL=pdl, num_warps=4,
                    launch_pdl=pdl)
    return out


@triton.jit
def _attend_block(q, k, v, s, pos, vis_ptr, m, acc, total, scale, HAS_VIS: tl.constexpr):
    """Online softmax over one block of cache slots s (k, v (BLOCK_S, D) float32, zeros past pos)."""
    used = s <= pos
    seen = used
    if HAS_VIS:
        seen = used & (tl.load(vis_ptr + s, mask=used, other=0) <= pos)
    sc = tl.where(seen, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
    m_new = tl.maximum(tl.max(sc, 0), m)
    p = tl.exp(sc - m_new)
    alpha = tl.exp(m - m_new)
    return m_new, acc * alpha + tl.sum(p[:, None] * v, 0), total * alpha + tl.sum(p, 0)


@triton.jit
def _attend(q_ptr, kc_ptr, vc_ptr, vis_ptr, pos_ptr, out_ptr, part_ptr, cnt_ptr, scale, max_len,
            SPLITS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, HAS_VIS: tl.constexpr,
            BLOCK_S: tl.constexpr, NB: tl.constexpr, PDL: tl.constexpr = False):
    """Program (h, j): query head h against the cache blocks j, j + SPLITS, ... of BLOCK_S slots
    up to the position (split-K "flash decoding", online softmax across a program's blocks); each
    split leaves (unnormalised output, max, sum) in `part`, and the head's last split to finish
    (counted with an atomic, reset for the next step) merges them in a fixed order.

    Only q and the current slot's k/v come from the previous kernel (the q/k/v projection): the
    position (written before the step's first kernel) and the program's first block of older slots
    are loaded before `_wait_previous`, so under PDL those loads overlap the previous kernel."""
    h = tl.program_id(0)
    j = tl.program_id(1)
    pos = tl.load(pos_ptr)
    n_blocks = pos // BLOCK_S + 1
    n_used = tl.minimum(n_blocks, SPLITS)
    hk = h // GROUP
    dd = tl.arange(0, D)
    s = j * BLOCK_S + tl.arange(0, BLOCK_S)
    older = s < tl.where(j < n_used, pos, 0)  # slots before the current one, if this split has any
    off = (hk * max_len + s)[:, None] * D + dd[None, :]
    k = tl.load(kc_ptr + off, mask=older[:, None], other=0.0).to(tl.float32)
    v = tl.load(vc_ptr + off, mask=older[:, None], other=0.0).to(tl.float32)
    _wait_previous(PDL)
    if j < n_used:
        q = tl.load(q_ptr + h * D + dd).to(tl.float32)
        now = (s == pos)[:, None]
        k = tl.where(now, tl.load(kc_ptr + (hk * max_len + pos) * D + dd).to(tl.float32)[None, :], k)
        v = tl.where(now, tl.load(vc_ptr + (hk * max_len + pos) * D + dd).to(tl.float32)[None, :], v)
        m, acc, total = _attend_block(q, k, v, s, pos, vis_ptr, -1e30, tl.zeros([D], dtype=tl.float32), 0.0, scale,
                                      HAS_VIS)  # m: finite even when no slot of the split is seen
        for blk0 in range(SPLITS, NB, SPLITS):  # every SPLITS-th block from j, up to the position's
            if blk0 + j < n_blocks:
                s = (blk0 + j) * BLOCK_S + tl.arange(0, BLOCK_S)
                off = (hk * max_len + s)[:, None] * D + dd[None, :]
                used = (s <= pos)[:, None]
                k = tl.load(kc_ptr + off, mask=used, other=0.0).to(tl.float32)
                v = tl.load(vc_ptr + off, mask=used, other=0.0).to(tl.float32)
                m, acc, total = _attend_block(q, k, v, s, pos, vis_ptr, m, acc, total, scale, HAS_VIS)
        _let_next(PDL)
        base = part_ptr + (h * SPLITS + j) * (D + 2)
        tl.store(base + dd, acc)
        tl.store(base + D, m)
        tl.store(base + D + 1, total)
        if _arrive_last(cnt_ptr + h, n_used):
            js = tl.arange(0, triton.next_power_of_2(SPLITS))
            jm = js < n_used
            rows = part_ptr + (h * SPLITS + js) * (D + 2)
            ms = tl.load(rows + D, mask=jm, other=float("-inf"), cache_modifier=".cg")
            w = tl.exp(ms - tl.max(ms, 0))
            ls = tl.load(rows + D + 1, mask=jm, other=0.0, cache_modifier=".cg")
            accs = tl.load(rows[:, None] + dd[None, :], mask=jm[:, None], other=0.0, cache_modifier=".cg")
            y = tl.sum(w[:, None] * accs, 0) / tl.sum(w * ls, 0)
            tl.store(out_ptr + h * D + dd, y.to(q_ptr.dtype.element_ty))
            tl.store(cnt_ptr + h, 0)


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
    scale, zero = _row_params(s_ptr, z_ptr, rows, rm, K, Q4, GS)
    pre = _first(w_ptr, row0, row0, N, k_lo, K, BLOCK_R, BLOCK_K, Q4, False, PIPE)
    _wait_previous(PDL)
    res = 0.0
    if RESIDUAL:  # read now, not at the end of the program
        res = tl.load(x_ptr + rows, mask=rm, other=0.0).to(tl.float32)
    acc, _, _, vz = _k_loop(pre, w_ptr, s_ptr, z_ptr, row0, row0, N, y_ptr, y_ptr, k_lo, K, KS, BLOCK_R, BLOCK_K, VW,
                            Q4, GS, False, False, STAGES, PDL, PIPE)
    t = _total(acc, vz, zero, K, BLOCK_R, Q4, GS)  # row sums over this program's inputs, before the scale
    if SPLIT == 1:
        _gemv_out(t, scale, res, out_ptr, rows, rm, K, RESIDUAL, Q4, GS, y_ptr.dtype.element_ty)
    else:
        r = tl.arange(0, BLOCK_R)
        tl.store(part_ptr + (blk * SPLIT + tl.program_id(1)) * BLOCK_R + r, t)
        if _arrive_last(cnt_ptr + blk, SPLIT):
            t = _sum_parts(part_ptr + blk * SPLIT * BLOCK_R, r, BLOCK_R, SPLIT)
            _gemv_out(t, scale, res, out_ptr, rows, rm, K, RESIDUAL, Q4, GS, y_ptr.dtype.element_ty)
            tl.store(cnt_ptr + blk, 0)


@triton.jit
def _gemv_out(t, scale, res, out_ptr, rows, rm, K: tl.constexpr, RESIDUAL: tl.constexpr, Q4: tl.constexpr,
              GS: tl.constexpr, dtype: tl.constexpr):
    """`_gemv`'s rows from their sums t: scale, rounding, residual (res, float32)."""
    o = _rnd(_row_scale(t, scale, K, Q4, GS), dtype)
    if RESIDUAL:
        o = _rnd(res + o, dtype)
    tl.store(out_ptr + rows, o.to(out_ptr.dtype.element_ty), mask=rm)


class Weight:
    """A projection's weight as the kernels take it: dense (N, K), or 4-bit (`q4`, see `_mac`)."""

    def __init__(self, w: Tensor, scales: Tensor | None = None, zeros: Tensor | None = None, group: int = 0):
        """Dense: w (N, K). 4-bit: w int32 (ceil(N/4), K/8, 4) (see `_mac`), float32 scales and
        zeros (N, groups), `group` inputs per group."""
        self.w, self.scales, self.zeros = w, scales, zeros
        self.q4 = scales is not None
        self.n = scales.shape[0] if self.q4 else w.shape[0]
        self.k = w.shape[1] * 8 if self.q4 else w.shape[1]
        self.group = group if self.q4 else self.k
        if self.q4 and (w.dim() != 3 or w.shape[2] != 4 or w.shape[0] * 4 < self.n):
            raise ValueError(f"4-bit weight words must be (ceil(N/4), K/8, 4), got {tuple(w.shape)} for N={self.n}")

    @classmethod
    def of(cls, linear) -> Weight:
        """From an nn.Linear, or anything with a `kernel_weight()` (backends/int4.py's Q4Linear)."""
        return linear.kernel_weight() if hasattr(linear, "kernel_weight") else cls(linear.weight)

    def args(self) -> tuple:
        s = self.scales if self.q4 else self.w
        return self.w, s, self.zeros if self.q4 else self.w

    def block_k(self, want: int) -> int:
        """K per iteration: a power of two."""
        return min(want, triton.next_power_of_2(self.k))

    def vw(self, want: int) -> int:
        """Accumulator columns for that K block (a 4-bit word's eight values share one)."""
        return self.block_k(want) // (8 if self.q4 else 1)


class SplitScratch:
    """Partial sums and counters for split-K `gemv` calls (zeroed counters; each call leaves them
    zeroed). One serves any number of calls in stream order."""

    def __init__(self, device, sums: int = 0, blocks: int = 0):
        self.device, self.part, self.count = device, None, None
        self.reserve(sums, blocks)

    def reserve(self, sums: int, blocks: int) -> None:
        if self.part is None or self.part.numel() < sums:
            self.part = torch.zeros(max(sums, 1), dtype=torch.float32, device=self.device)
        if self.count is None or self.count.numel() < blocks:
            self.count = torch.zeros(max(blocks, 1), dtype=torch.int32, device=self.device)


def split_k(k: int, bk: int, split: int) -> tuple[int, int]:
    """(programs per output block, inputs each) of a split-K product over k inputs in blocks of bk:
    the blocks shared out evenly over at most `split` programs."""
    ks = triton.cdiv(triton.cdiv(k, bk), max(split, 1)) * bk
    return triton.cdiv(k, ks), ks


def gemv(w: Weight, y: Tensor, out: Tensor, residual: Tensor | None = None, *, rows: int = 4,
         block_k: int = 512, warps: int = 4, stages: int = 1, split: int = 1,
         scratch: SplitScratch | None = None, pdl: bool = False, pipe: bool = False) -> Tensor:
    """out = W @ y (+ residual) for y (K,); out may be residual (in place). `stages` > 1 pipelines
    the loads of that many K-blocks (asynchronous copies through shared memory): of the inputs, and
    with `pipe` of 4-bit words too (else the next block's words are loaded into registers while one
    is computed, the first before `_wait_previous`); `split` > 1 shares
    K out over that many programs per row block (sums in `scratch`, which grows to fit); `pdl`:
    launched as a programmatic dependent of the previous kernel (see `_wait_previous`)."""
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


@triton.jit
def _q4_dequant(w_ptr, s_ptr, z_ptr, out_ptr, n0, N: tl.constexpr, K: tl.constexpr, GS: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[r, :] = W[n0 + r, :] dequantized to out's dtype (a 4-bit weight, see `_mac`)."""
    rows = n0 + tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = rows < N
    kw = tl.program_id(1) * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    km = kw < K // 8
    word = ((rows // 4) * (K // 8))[:, None] * 4 + kw[None, :] * 4 + (rows % 4)[:, None]  # rows interleaved by 4
    words = tl.load(w_ptr + word, mask=rm[:, None] & km[None, :], other=0)
    zero, scale = _zero_scale(s_ptr, z_ptr, rows, rm, kw, km, K, GS)
    pairs = _pairs(words)
    lo = ((pairs & 0xFFFF) | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + q
    hi = ((pairs >> 16) | 0x4B000000).to(tl.float32, bitcast=True)
    q = tl.reshape(tl.join(lo, hi), [BLOCK_R, BLOCK_K // 8, 8])  # in input order: contiguous stores
    w = (q - zero[:, :, None]) * scale[:, :, None]
    cols = kw[:, None] * 8 + tl.arange(0, 8)[None, :]
    off = (rows - n0)[:, None, None] * K + cols[None, :, :]
    tl.store(out_ptr + off, w.to(out_ptr.dtype.element_ty), mask=rm[:, None, None] & km[None, :, None])


SCRATCH = 1 << 25  # elements of the dequantized slice of a 4-bit weight a prefill works on (64 MB in bf16)


@triton.jit
def _q4_mm(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr, M, N: tl.constexpr, K: tl.constexpr,
           HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
           SPLIT: tl.constexpr, KS: tl.constexpr, STAGES: tl.constexpr, MAGIC: tl.constexpr, BASE: tl.constexpr,
           ONE: tl.constexpr, FMA: tl.constexpr, INTERPRETED: tl.constexpr = False):
    """out (M, N) = x (M, K) @ W^T (+ bias) for a one-group 4-bit W (`_mac`'s layout), the prefill
    product. Program (i, j, s): rows n of W from i * BLOCK_N against tokens t from j * BLOCK_T, on
    inputs s * KS..: each K-block of W is unpacked in registers for a tensor-core product with the
    tokens' inputs (float32 sums; W is the left operand, so a few tokens fill the narrow side of
    the product; the tokens as the left operand, the unpacked weights through shared memory, was
    slower at 64 and 128 tokens on an H100), and the row scale multiplies the sums.

    One AND of a word shifted by 4p gives its values 2p and 2p + 1 (`pair_nibbles`) in its 16-bit
    halves. 16-bit x (MAGIC, the 16-bit pattern of BASE = 2^m: 128.0 in bfloat16, 1024.0 in
    float16): `_pairs16` makes them the 16-bit floats q - z, exactly, in three instructions a
    pair (shift, LOP3, paired FMA); the zero point subtracted there instead of (2^m + z) * sum(x)
    off the sums at the end took the inputs' sums out of the loop (179 -> 137 sm_90 instructions
    a K-block for gate/up at 64 tokens, 266 -> 166 for down). float32 x: (q - z), exactly.
    SPLIT > 1: as `_gemv`, each program leaves its sums in `part` and a tile's last program to
    finish adds them in a fixed order and writes the tile."""
    pn = tl.program_id(0)
    pt = tl.program_id(1)
    ps = tl.program_id(2)
    dtype = x_ptr.dtype.element_ty
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    t = pt * BLOCK_T + tl.arange(0, BLOCK_T)
    nm = n < N
    tm = t < M
    zero = tl.load(z_ptr + n, mask=nm, other=0.0)
    quad = (pn * (BLOCK_N // 4) + tl.arange(0, BLOCK_N // 4))[:, None, None]
    lane = tl.arange(0, 4)[None, None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    if MAGIC and not INTERPRETED:  # -(2^m + z) as a 16-bit float in both halves of a word
        nz = ((-(BASE + zero[:, None, None])).to(dtype).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) * 65537
    elif MAGIC:  # what comes off the 16-bit floats 2^m + q (float32 below)
        zero16 = (BASE + zero)[:, None, None]
    else:
        zero16 = zero[:, None, None]
    k_lo = ps * KS
    for i in tl.range(0, KS, BLOCK_K, num_stages=STAGES):
        kw = (k_lo + i) // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(w_ptr + (quad * (K // 8) + kw[None, :, None]) * 4 + lane,
                        mask=(quad * 4 < N) & (kw < K // 8)[None, :, None], other=0)  # (quads, words, 4 rows)
        words = tl.reshape(tl.permute(words, (0, 2, 1)), [BLOCK_N, BLOCK_K // 8])  # row n = quad * 4 + lane
        k = (k_lo + i) + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + t[None, :] * K + k[:, None], mask=tm[None, :] & (k < K)[:, None], other=0.0)
        if MAGIC and not INTERPRETED:
            pairs = _pairs16(words, nz, MAGIC, ONE, FMA)
            lo = pairs.to(tl.int16).to(dtype, bitcast=True)  # q - z
            hi = (pairs >> 16).to(tl.int16).to(dtype, bitcast=True)
            wq = tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K])  # inputs in order
            acc = tl.dot(wq, xt, acc)
        else:  # float32 models (no TF32), and Triton's interpreter (3.6), which multiplies 16-bit floats
            # wrongly: exact in float32
            pairs = _pairs(words)
            if MAGIC:  # the same 16-bit floats 2^m + q, then 2^m + z off them
                pairs = pairs | (MAGIC * 65537)
                lo = pairs.to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
                hi = (pairs >> 16).to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
            else:
                lo = (pairs & 0xFFFF).to(tl.float32)
                hi = (pairs >> 16).to(tl.float32)
            wq = tl.reshape(tl.join(lo - zero16, hi - zero16), [BLOCK_N, BLOCK_K])  # q - z: exact
            acc = tl.dot(wq, xt.to(tl.float32), acc, input_precision="ieee")
    if SPLIT == 1:
        _q4_mm_out(acc, s_ptr, b_ptr, out_ptr, n, nm, t, tm, N, HAS_BIAS, dtype)
    else:
        tile = pn * tl.num_programs(1) + pt
        cell = tl.arange(0, BLOCK_N)[:, None] * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
        tl.store(part_ptr + (tile * SPLIT + ps) * (BLOCK_N * BLOCK_T) + cell, acc)
        if _arrive_last(cnt_ptr + tile, SPLIT):
            acc = _sum_parts(part_ptr + tile * SPLIT * (BLOCK_N * BLOCK_T), cell, BLOCK_N * BLOCK_T, SPLIT)
            _q4_mm_out(acc, s_ptr, b_ptr, out_ptr, n, nm, t, tm, N, HAS_BIAS, dtype)
            tl.store(cnt_ptr + tile, 0)


@triton.jit
def _q4_mm_out(acc, s_ptr, b_ptr, out_ptr, n, nm, t, tm, N: tl.constexpr, HAS_BIAS: tl.constexpr, dtype: tl.constexpr):
    """`_q4_mm`'s tile from its sums (rows n, tokens t): row scale, bias, one rounding (as addmm)."""
    y = acc * tl.load(s_ptr + n, mask=nm, other=0.0)[:, None]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + t[None, :] * N + n[:, None], y.to(dtype), mask=nm[:, None] & tm[None, :])


def q4_mm_config(m: int, w: Weight) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_N, BLOCK_T, BLOCK_K, warps, stages, split) of `_q4_mm` for m tokens, after sweeps on
    an H200 (tools/q4mm_sweep.py, docs/benchmarks.md): tiles of 64 rows (four warps) against up to
    128 tokens. A weight of many rows (gate/up: four tiles per SM or more) is not split, K-blocks of
    64, 4 stages (3 past 128 tokens). A long one (down: K at least 4 N) takes K-blocks of 64 split
    for about six programs per SM up to 32 tokens, four at 64 tokens, K-blocks of 128 for about one
    past 64. The others (q/k/v, o): K-blocks of 128 for about four programs per SM up to 32 tokens,
    K-blocks of 64 for about two at 64 tokens, K-blocks of 128 for about one past 64. Tiles of 128
    rows against 128 tokens gave wrong sums (Triton 3.6, H100 and H200): the shapes here keep clear
    of them."""
    bt = min(max(16, triton.next_power_of_2(m)), 128)
    sms = _sm_count(w.w.device)
    if triton.cdiv(w.n, 64) * triton.cdiv(m, bt) >= 4 * sms:
        bk, stages, per_sm = 64, 4 if m <= 128 else 3, 1
    elif w.k >= 4 * w.n:
        bk, stages, per_sm = (64, 3, 6) if bt <= 32 else (64, 4, 4) if bt == 64 else (128, 3, 1)
    else:
        bk, stages, per_sm = (128, 3, 4) if bt <= 32 else (64, 3, 2) if bt == 64 else (128, 3, 1)
    return 64, bt, bk, 4, stages, q4_mm_split(m, w, 64, bt, bk, per_sm * sms)


def q4_mm_split(m: int, w: Weight, bn: int, bt: int, bk: int, programs: int) -> int:
    """Programs per output tile of `_q4_mm` (split K) for about `programs` in all, each at least
    four K-blocks."""
    tiles = triton.cdiv(w.n, bn) * triton.cdiv(m, bt)
    return max(1, min(triton.cdiv(programs, tiles), triton.cdiv(w.k, bk) // 4))


_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_MAGIC = {torch.bfloat16: (0x4300, 128.0, 0x3F80, "fma.rn.bf16x2"),  # `_q4_mm`: 2^m as a 16-bit pattern, 2^m,
          torch.float16: (0x6400, 1024.0, 0x3C00, "fma.rn.f16x2")}    # 1.0's pattern, the paired FMA
MM_MAX_M = 512  # prefills up to this many tokens take `q4_mm` (the range swept); above, dequantize + cuBLAS


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a GPU, which the prefill product aims to fill (132 on an H100
    or H200, also assumed for a CPU: the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def q4_mm(x: Tensor, w: Weight, bias: Tensor | None, cfg: tuple | None = None) -> Tensor:
    """x (M, K) contiguous @ W^T + bias -> (M, N) in x's dtype on `_q4_mm` (one-group 4-bit W);
    `cfg` (BLOCK_N, BLOCK_T, BLOCK_K, warps, stages, split) overrides `q4_mm_config`."""
    m = x.shape[0]
    bn, bt, bk, warps, stages, split = cfg or q4_mm_config(m, w)
    bk = min(bk, max(16, triton.next_power_of_2(w.k)))
    split, ks = split_k(w.k, bk, split)
    grid = (triton.cdiv(w.n, bn), triton.cdiv(m, bt), split)
    y = torch.empty(m, w.n, dtype=x.dtype, device=x.device)
    if split > 1:
        part = torch.empty(grid[0] * grid[1] * split * bn * bt, dtype=torch.float32, device=x.device)
        count = torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=x.device)
    else:
        part = count = y
    _q4_mm[grid](x, *w.args(), bias if bias is not None else y, y, part, count, m, N=w.n, K=w.k,
                 HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_T=bt, BLOCK_K=bk, SPLIT=split, KS=ks, STAGES=stages,
                 **dict(zip(("MAGIC", "BASE", "ONE", "FMA"), _MAGIC.get(x.dtype, (0, 0.0, 0, "")))),
                 INTERPRETED=_INTERPRETED, num_warps=warps)
    return y


def q4_linear(x: Tensor, w: Weight, bias: Tensor | None) -> Tensor:
    """x (M, K) contiguous -> x @ W^T + bias (M, N) in x's dtype, for a 4-bit W. One row: the GEMV
    kernel. More (prefills): with one group (the official layout) `q4_mm`; with groups, slices of
    W dequantized to x's dtype into a scratch buffer and multiplied by cuBLAS, which is what the
    same layer with dequantized weights computes."""
    m = x.shape[0]
    if m == 1:
        y = gemv(w, x[0], torch.empty(w.n, dtype=x.dtype, device=x.device))[None]
        return y if bias is None else y + bias
    if w.group == w.k and m <= MM_MAX_M:
        return q4_mm(x, w, bias)
    y = torch.empty(m, w.n, dtype=x.dtype, device=x.device)
    rows = max(64, SCRATCH // w.k // 64 * 64)
    scratch = torch.empty(min(rows, w.n), w.k, dtype=x.dtype, device=x.device)
    for n0 in range(0, w.n, rows):
        n1 = min(n0 + rows, w.n)
        part = scratch[: n1 - n0]
        _q4_dequant[(triton.cdiv(n1 - n0, 16), triton.cdiv(w.k, 256))](*w.args(), part, n0, N=n1, K=w.k, GS=w.group,
                                                                      BLOCK_R=16, BLOCK_K=256)
        if bias is None:
            y[:, n0:n1] = x @ part.T
        else:
            y[:, n0:n1] = torch.addmm(bias[n0:n1], x, part.T)
    return y


@triton.jit
def _rms_gate_up(x_ptr, nw_ptr, w_ptr, s_ptr, z_ptr, h_ptr, eps, DIM: tl.constexpr, INTER: tl.constexpr,
                 Q4: tl.constexpr, GS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                 VW: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False, PIPE: tl.constexpr = False):
    """h[rows] = silu(gate) * up of RMSNorm(x), W = [gate; up] stacked (2 * INTER, DIM)."""
    row0 = tl.program_id(0) * BLOCK_R
    rows = row0 + tl.arange(0, BLOCK_R)
    rm = rows < INTER
    dtype = x_ptr.dtype.element_ty
    pre = _first(w_ptr, row0, row0 + INTER, INTER, 0, DIM, BLOCK_R, BLOCK_K, Q4, True, PIPE)
    sc_g, z_g = _row_params(s_ptr, z_ptr, rows, rm, DIM, Q4, GS)
    sc_u, z_u = _row_params(s_ptr, z_ptr, rows + INTER, rm, DIM, Q4, GS)
    _wait_previous(PDL)
    acc_g, acc_u, ss, vz = _k_loop(pre, w_ptr, s_ptr, z_ptr, row0, row0 + INTER, INTER, x_ptr, nw_ptr, 0, DIM, DIM,
                                   BLOCK_R, BLOCK_K, VW, Q4, GS, True, True, STAGES, PDL, PIPE)
    inv = 1.0 / tl.sqrt(tl.sum(ss, 0) / DIM + eps)
    g = _rnd(_row_scale(_total(acc_g, vz, z_g, DIM, BLOCK_R, Q4, GS), sc_g, DIM, Q4, GS) * inv, dtype)
    u = _rnd(_row_scale(_total(acc_u, vz, z_u, DIM, BLOCK_R, Q4, GS), sc_u, DIM, Q4, GS) * inv, dtype)
    act = _rnd(g / (1.0 + tl.exp(-g)), dtype)
    tl.store(h_ptr + rows, (act * u).to(dtype), mask=rm)


def cuda_gate_up_fits(w: Weight, x: Tensor, chunks: int = 2) -> bool:
    """Whether `cuda_gate_up` takes this gate/up weight and input: one-group 4-bit, bfloat16 on a
    CUDA GPU with bfloat16 tensor-core products (compute capability 8.0 and later), K in `chunks`
    parts of whole 512-byte loads of a warp (as backends/q4_decode.cu asserts)."""
    return (w.q4 and w.group == w.k and x.dtype == torch.bfloat16 and x.device.type == "cuda"
            and torch.cuda.get_device_capability(x.device) >= (8, 0) and chunks > 0 and w.k % (256 * chunks) == 0
            and (w.n // 2) % 4 == 0)


def cuda_gate_up(w: Weight, x: Tensor, gain: Tensor, h: Tensor, eps: float, *, warps: int = 4, chunks: int = 2,
                 stages: int = 2, pdl: bool = False) -> None:
    """`_rms_gate_up` for a one-group 4-bit weight (`cuda_gate_up_fits`) on the CUDA C kernel of
    backends/q4_decode.cu: blocks of `warps` warps, as many as fit on the GPU at once, each warp
    walking its quads in `chunks` parts of K with `stages` of them loaded or in flight. Unlike
    `_rms_gate_up`, the RMSNorm's output is rounded to bfloat16 before the product, as the eager
    layer rounds it."""
    from . import cuda

    inter = w.n // 2
    k = cuda.kernel("q4_decode.cu", "q4_rms_gate_up", x.device,
                    (("DIM", w.k), ("INTER", inter), ("WARPS", warps), ("CHUNKS", chunks), ("STAGES", stages),
                     ("PDL", int(pdl))))
    blocks = min(triton.cdiv(inter // 4, warps), _sm_count(x.device) * k.blocks_per_sm(32 * warps))
    k((blocks,), 32 * warps, x, gain, w.w, w.scales, w.zeros, h, float(eps), pdl=pdl)


@triton.jit
def _sample_codes(raw_ptr, temp_ptr, bos_ptr, block_eos_ptr, noise_ptr, probs_ptr, code_ptr, top_p,
                  V: tl.constexpr, TOP_K: tl.constexpr, MIN_KEEP: tl.constexpr, SAMPLED: tl.constexpr,
                  BLOCK_V: tl.constexpr):
    """One codebook per program: logits / temperature, then (except on the BOS step) top-p and
    top-k as transformers' warpers keep them, EOS (the last code) blocked when asked, softmax, and
    the argmax of probs (greedy) or of probs / noise (a draw, see minicpm_cli.sampling.choose)."""
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK_V)
    inside = i < V
    t = tl.load(temp_ptr + row)
    x = tl.math.div_rn(tl.load(raw_ptr + row * V + i, mask=inside, other=float("-inf")), t)
    # top-p: the token of descending rank r stays if the probability mass of ranks < r is below p
    # (i.e. its ascending cumulative mass exceeds 1 - p), the first MIN_KEEP always; top-k keeps
    # the K largest of those. Both keep a prefix of the ranking, so the K largest are walked one at
    # a time (no full sort) and the last kept value becomes the threshold (ties at it stay).
    top = tl.max(x, 0)
    mass = tl.sum(tl.exp(x - top), 0)
    rest = x
    above = 0.0
    cut = top
    for r in tl.static_range(TOP_K):
        at = tl.argmax(rest, 0)
        v = tl.max(rest, 0)
        cut = tl.where((r < MIN_KEEP) | (above < top_p * mass), v, cut)
        above += tl.exp(v - top)
        rest = tl.where(i == at, float("-inf"), rest)
    warped = tl.where(x >= cut, x, float("-inf"))
    x = tl.where(tl.load(bos_ptr) != 0, x, warped)
    x = tl.where((i == V - 1) & (tl.load(block_eos_ptr) != 0), float("-inf"), x)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    tl.store(probs_ptr + row * V + i, p, mask=inside)
    if SAMPLED:
        score = p / tl.load(noise_ptr + row * V + i, mask=inside, other=1.0)
    else:
        score = p
    tl.store(code_ptr + row, tl.argmax(tl.where(inside, score, -1.0), 0))


def sample_codes(raw: Tensor, temps: Tensor, bos: Tensor, block_eos: Tensor, noise: Tensor | None,
                 probs: Tensor, codes: Tensor, top_p: float, top_k: int, min_keep: int) -> None:
    """`_sample_codes` over raw (num_vq, V) float32 logits -> probs (num_vq, V), codes (num_vq,)."""
    q, v = raw.shape
    _sample_codes[(q,)](raw, temps, bos, block_eos, noise if noise is not None else raw, probs, codes, top_p,
                        V=v, TOP_K=max(top_k, min_keep), MIN_KEEP=min_keep, SAMPLED=noise is not None,
                        BLOCK_V=triton.next_power_of_2(v), num_warps=2)


def _launch(shape: tuple, n: int) -> tuple:
    """A `TritonDecode.cfg` launch shape padded with zeros to n + 1 elements (the optional last ones,
    e.g. PIPE, 0 where absent)."""
    return tuple(shape) + (0,) * (n + 1 - len(shape))


def kernels_scratch(cfg: dict, wo: Weight, wdown: Weight, device) -> SplitScratch:
    """Split-K scratch for the o and down launches of `cfg` (sized up front: nothing is allocated
    while a graph is captured, and `cfg` may change before, as the sweeps do)."""
    scratch = SplitScratch(device)
    for name, w in (("o", wo), ("down", wdown)):
        r, k, _, _, sp = cfg[name][:5]
        sp = split_k(w.k, w.block_k(k), sp)[0]
        blocks = triton.cdiv(w.n, r)
        scratch.reserve(blocks * sp * r if sp > 1 else 0, blocks if sp > 1 else 0)
    return scratch


class TritonDecode:
    """One-token decode through a fused `Decoder` (q/k/v and gate/up fused, KV cache and rotary
    tables set up) with the kernels above. `__call__(x, pos)` takes the input embedding (dim,) and a
    1-element position tensor and returns the last layer's residual stream (dim,), before the final
    norm, in a static buffer. Capturable in a CUDA graph: no host synchronisation, no
    position-dependent shapes. `visible_from` (slots,): a slot is seen from that position on
    (the TTS mask); None means causal. `pdl`: launch the kernels as programmatic dependents
    (`_wait_previous`; the default on Hopper and later GPUs, never in Triton's interpreter)."""

    def __init__(self, decoder: Decoder, visible_from: Tensor | None = None, pdl: bool | None = None):
        c = decoder.config
        self.c, self.decoder, self.visible_from = c, decoder, visible_from
        first = decoder.layers[0]
        attn = first.self_attn
        if attn.qkv_proj is None or first.mlp.gate_up_proj is None or attn.kv_cache is None:
            raise ValueError("TritonDecode needs a fused decoder with a KV cache")
        if decoder.rope_cos is None:
            raise ValueError("TritonDecode needs the rotary tables (Decoder.setup_rope)")
        self.weights = [tuple(Weight.of(p) for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                      layer.mlp.gate_up_proj, layer.mlp.down_proj))
                        for layer in decoder.layers]
        self.max_len = attn.kv_cache.k.shape[2]
        dev, dt = attn.kv_cache.k.device, attn.kv_cache.k.dtype
        self.x = torch.zeros(c.dim, dtype=dt, device=dev)
        self.q = torch.zeros(c.n_heads * c.head_dim, dtype=dt, device=dev)
        self.y = torch.zeros(c.n_heads * c.head_dim, dtype=dt, device=dev)
        self.h = torch.zeros(c.intermediate, dtype=dt, device=dev)
        # Launch shapes per kernel: (rows per program, K per iteration, warps, K-blocks whose loads
        # are in flight at once[, programs per row block (split-K) for o and down][, 1: 4-bit
        # words through Triton's pipelining, see `_k_loop`]); the qkv
        # kernel's rows are per half head. The best of a sweep on an H200 (docs/benchmarks.md): a
        # small model wants all of K in one iteration (latency), a large one more, shorter programs.
        # "gate_up_cuda": (warps a block, chunks of K, stages) of `cuda_gate_up`, which a 4-bit
        # bfloat16 step on a GPU runs instead of `_rms_gate_up` (`cuda_gate_up_fits`; 0: never).
        if self.weights[0][0].q4:  # 4-bit (int4 backend): swept on the H200 like the others; the
            # words through Triton's pipelining, programs of one or two warps
            self.cfg = {"qkv": (4, 1024, 2, 3, 1), "o": (4, 512, 1, 4, 1, 1), "gate_up": (8, 512, 1, 4, 1),
                        "down": (8, 1024, 2, 4, 1, 1), "gate_up_cuda": (4, 2, 2)}
        elif c.dim <= 1024:
            k = triton.next_power_of_2(c.dim)
            self.cfg = {"qkv": (8, k, 4, 1), "o": (8, k, 4, 1, 1), "gate_up": (8, k, 4, 1), "down": (8, 1024, 4, 1, 1)}
        else:
            self.cfg = {"qkv": (8, 512, 4, 1), "o": (4, 512, 4, 1, 1), "gate_up": (4, 256, 4, 1),
                        "down": (2, 2048, 8, 1, 1)}
        self.scratch = kernels_scratch(self.cfg, self.weights[0][1], self.weights[0][3], dev)
        if pdl is None:
            pdl = dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9
        self.pdl = pdl
        self.block_s = 64
        self.max_splits = 16  # programs per head (each takes every 16th block of slots); sizes `part`
        self.attn_warps = 4
        # attention partials (output, max, sum) per head and split (at most max_splits, whatever
        # block_s), and per-head split counters
        self.part = torch.zeros(c.n_heads * self.max_splits * (c.head_dim + 2), dtype=torch.float32, device=dev)
        self.count = torch.zeros(c.n_heads, dtype=torch.int32, device=dev)

    def __call__(self, x: Tensor, pos: Tensor) -> Tensor:
        c, dec, cfg, pdl = self.c, self.decoder, self.cfg, self.pdl
        D, H, Hkv = c.head_dim, c.n_heads, c.n_kv_heads
        if x is not self.x:  # (the LLM embeds straight into self.x)
            self.x.copy_(x.reshape(-1))
        vis = self.visible_from if self.visible_from is not None else pos
        splits = min(triton.cdiv(self.max_len, self.block_s), self.max_splits)
        qr, qk, qw, qs, qp = _launch(cfg["qkv"], 4)
        qr = min(qr, D // 2)
        gr, gk, gw, gs, gp = _launch(cfg["gate_up"], 4)
        r_o, k_o, w_o, st_o, sp_o, p_o = _launch(cfg["o"], 5)
        r_d, k_d, w_d, st_d, sp_d, p_d = _launch(cfg["down"], 5)
        gc_warps, gc_chunks, gc_stages = _launch(cfg.get("gate_up_cuda", (0,)), 2)
        gc = gc_warps > 0 and cuda_gate_up_fits(self.weights[0][2], self.x, gc_chunks)
        for layer, (wqkv, wo, wgu, wdown) in zip(dec.layers, self.weights):
            a = layer.self_attn
            bias = a.qkv_proj.bias
            _rms_qkv_rope[(H + 2 * Hkv, D // 2 // qr)](
                self.x, layer.input_layernorm.weight, *wqkv.args(), bias if bias is not None else self.x,
                dec.rope_cos, dec.rope_sin, pos, self.q, a.kv_cache.k, a.kv_cache.v, layer.input_layernorm.eps,
                self.max_len, DIM=c.dim, HQ=H, HKV=Hkv, D=D, HAS_BIAS=bias is not None, Q4=wqkv.q4,
                GS=wqkv.group, BLOCK_R=qr, BLOCK_K=wqkv.block_k(qk), VW=wqkv.vw(qk), STAGES=qs, PDL=pdl,
                PIPE=bool(qp), num_warps=qw, launch_pdl=pdl)
            _attend[(H, splits)](self.q, a.kv_cache.k, a.kv_cache.v, vis, pos, self.y, self.part, self.count,
                                 D**-0.5, self.max_len, SPLITS=splits, GROUP=H // Hkv, D=D,
                                 HAS_VIS=self.visible_from is not None, BLOCK_S=self.block_s,
                                 NB=triton.cdiv(self.max_len, self.block_s), PDL=pdl, num_warps=self.attn_warps,
                                 launch_pdl=pdl)
            gemv(wo, self.y, self.x, self.x, rows=r_o, block_k=k_o, warps=w_o, stages=st_o, split=sp_o,
                 scratch=self.scratch, pdl=pdl, pipe=bool(p_o))
            if gc:
                cuda_gate_up(wgu, self.x, layer.post_attention_layernorm.weight, self.h,
                             layer.post_attention_layernorm.eps, warps=gc_warps, chunks=gc_chunks, stages=gc_stages,
                             pdl=pdl)
            else:
                _rms_gate_up[(triton.cdiv(c.intermediate, gr),)](
                    self.x, layer.post_attention_layernorm.weight, *wgu.args(), self.h,
                    layer.post_attention_layernorm.eps, DIM=c.dim, INTER=c.intermediate, Q4=wgu.q4, GS=wgu.group,
                    BLOCK_R=gr, BLOCK_K=wgu.block_k(gk), VW=wgu.vw(gk), STAGES=gs, PDL=pdl, PIPE=bool(gp),
                    num_warps=gw, launch_pdl=pdl)
            gemv(wdown, self.h, self.x, self.x, rows=r_d, block_k=k_d, warps=w_d, stages=st_d, split=sp_d,
                 scratch=self.scratch, pdl=pdl, pipe=bool(p_d))
        return self.x
