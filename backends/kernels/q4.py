"""4-bit prefill products (more than one token): `q4_mm`, a tensor-core product of a one-group
4-bit weight with up to `MM_MAX_M` tokens (`_q4_mm`, launch shapes from `q4_mm_config`), and
`q4_linear`, which `Q4Linear` (backends/gptq.py) runs: one token on `gemv` (matvec.py), a
one-group weight on `q4_mm`, else slices of W dequantized (`_q4_dequant`) for cuBLAS. Both kernels
unpack `_mac`'s 4-bit layout (matvec.py) two values at a time, one in each 16-bit half of a word
(`_pairs`, `_pairs16`); `_zero_scale` loads the zero points and scales of a grouped weight.

Tests: tests/test_int4_kernels.py (`test_prefill_product_matches_dequantized` in float32, bfloat16
and float16 and several launch shapes, `test_q4_linear_matches_dequantized` with and without
groups, `test_split_products_leave_their_kept_counters_zeroed`; on a GPU
`test_prefill_product_full_size_on_gpu` at Qwen2-7B's shapes). The kept counters (`_counters`)
assume one stream at a time, as the engine runs; under the interpreter a kernel that fails midway
leaves its counts behind for the process (tests only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import INTERPRETED, Weight, arrive_last, sm_count, sum_parts, split_k
from .fallback import Fallback
from .matvec import gemv


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
        if arrive_last(cnt_ptr + tile, SPLIT):
            acc = sum_parts(part_ptr + tile * SPLIT * (BLOCK_N * BLOCK_T), cell, BLOCK_N * BLOCK_T, SPLIT)
            _q4_mm_out(acc, s_ptr, b_ptr, out_ptr, n, nm, t, tm, N, HAS_BIAS, dtype)
            tl.store(cnt_ptr + tile, 0)


@triton.jit
def _q4_mm_out(acc, s_ptr, b_ptr, out_ptr, n, nm, t, tm, N: tl.constexpr, HAS_BIAS: tl.constexpr, dtype: tl.constexpr):
    """`_q4_mm`'s tile from its sums (rows n, tokens t): row scale, bias, one rounding (as addmm). The
    compiler makes one FMA of the scale and the bias, which backends/q4_chain.cu repeats for the same
    bits: `q4_mm` launches with FP fusion on whatever Triton's default (TRITON_DEFAULT_FP_FUSION)."""
    y = acc * tl.load(s_ptr + n, mask=nm, other=0.0)[:, None]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + t[None, :] * N + n[:, None], y.to(dtype), mask=nm[:, None] & tm[None, :])


def q4_mm_config(m: int, w: Weight) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_N, BLOCK_T, BLOCK_K, warps, stages, split) of `_q4_mm` for m tokens, after sweeps on
    an H200 (tools/q4mm_sweep.py, docs/journal.md): tiles of 64 rows (four warps) against up to
    128 tokens. A weight of many rows (gate/up: four tiles per SM or more) is not split, K-blocks of
    64, 4 stages (3 past 128 tokens). A long one (down: K at least 4 N) takes K-blocks of 64 split
    for about six programs per SM up to 32 tokens, four at 64 tokens, K-blocks of 128 for about one
    past 64. The others (q/k/v, o): K-blocks of 128 for about four programs per SM up to 32 tokens,
    K-blocks of 64 for about two at 64 tokens, K-blocks of 128 for about one past 64. Tiles of 128
    rows against 128 tokens gave wrong sums (Triton 3.6, H100 and H200): the shapes here keep clear
    of them."""
    bt = min(max(16, triton.next_power_of_2(m)), 128)
    sms = sm_count(w.w.device)
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


_MAGIC = {torch.bfloat16: (0x4300, 128.0, 0x3F80, "fma.rn.bf16x2"),  # `_q4_mm`: 2^m as a 16-bit pattern, 2^m,
          torch.float16: (0x6400, 1024.0, 0x3C00, "fma.rn.f16x2")}    # 1.0's pattern, the paired FMA
MM_MAX_M = 512  # prefills up to this many tokens take `q4_mm` (the range swept); above, dequantize + cuBLAS


def q4_mm_parts(w: Weight, bk: int, split: int) -> tuple[int, int, int]:
    """`_q4_mm`'s (K-block, parts, inputs a part) for w from a launch shape's K-block and split: the
    block no longer than K's power of two, the parts whole blocks (`split_k`)."""
    bk = min(bk, max(16, triton.next_power_of_2(w.k)))
    return (bk, *split_k(w.k, bk, split))


def q4_mm(x: Tensor, w: Weight, bias: Tensor | None, cfg: tuple | None = None) -> Tensor:
    """x (M, K) contiguous @ W^T + bias -> (M, N) in x's dtype on `_q4_mm` (one-group 4-bit W);
    `cfg` (BLOCK_N, BLOCK_T, BLOCK_K, warps, stages, split) overrides `q4_mm_config`."""
    m = x.shape[0]
    bn, bt, bk, warps, stages, split = cfg or q4_mm_config(m, w)
    bk, split, ks = q4_mm_parts(w, bk, split)
    grid = (triton.cdiv(w.n, bn), triton.cdiv(m, bt), split)
    y = torch.empty(m, w.n, dtype=x.dtype, device=x.device)
    if split > 1:
        part = torch.empty(grid[0] * grid[1] * split * bn * bt, dtype=torch.float32, device=x.device)
        count = _counters(x.device, grid[0] * grid[1])
    else:
        part = count = y
    _q4_mm[grid](x, *w.args(), bias if bias is not None else y, y, part, count, m, N=w.n, K=w.k,
                 HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_T=bt, BLOCK_K=bk, SPLIT=split, KS=ks, STAGES=stages,
                 **dict(zip(("MAGIC", "BASE", "ONE", "FMA"), _MAGIC.get(x.dtype, (0, 0.0, 0, "")))),
                 INTERPRETED=INTERPRETED, num_warps=warps, enable_fp_fusion=True)  # (q4_chain's bits: below)
    return y


_COUNTERS: dict[torch.device, list[Tensor]] = {}


def _counters(device: torch.device, n: int) -> Tensor:
    """n zeroed split-K counters for `q4_mm`: a kept buffer a device, which each call leaves zeroed
    (the last program of a tile resets its count), so that a call costs no fill kernel (three a
    layer of the int4 token step). Calls share it in stream order: every q4_mm of a process runs on
    one stream at a time (the graph warm-up's stream is joined to the current one both ways). A
    buffer outgrown is kept, never freed: captured graphs still point at it. One too small while a
    CUDA graph is being captured is not grown there (a new buffer would only be zeroed when the graph
    replays): that call takes its own, zeroed in the graph, as every call did before."""
    kept = _COUNTERS.setdefault(device, [])
    if not kept or kept[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.zeros(n, dtype=torch.int32, device=device)
        kept.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return kept[-1][:n]


def q4_invariant(x: Tensor, w: Weight, bias: Tensor | None, pdl: bool = False) -> Tensor:
    """`q4_mm` cut so that a token's row of the output does not depend on how many tokens there
    are (backends/invariant.py): K-blocks of 64 and a split chosen from the weight alone (the one
    `q4_mm_config` takes at 16 tokens), whatever the count; tokens in tiles of up to 128 (which do
    not change a row's sums), at most MM_MAX_M at a time (which bounds the split's scratch). One
    token too: the GEMV's sums differ from a batch's. Where `chain_shape` names one (one token, and
    up to 8 of down), `q4_chain` gives the same sums sooner, as a programmatic dependent launch with
    `pdl` (`_q4_mm` launches plainly)."""
    if w.group != w.k:
        raise ValueError("the batch-invariant 4-bit product takes one-group weights (the official layout)")
    m = x.shape[0]
    if m <= CHAIN_MAX_M and q4_chain_fits(x, w, bias) and (shape := chain_shape(m, w)) is not None:
        return CHAIN.guard(lambda: q4_chain(x, w, bias, pdl=pdl, **shape),
                           lambda: q4_mm(x, w, bias, cfg=q4_invariant_config(m, w)), x.device)
    outs = []
    for t0 in range(0, x.shape[0], MM_MAX_M):
        part = x[t0 : t0 + MM_MAX_M]
        outs.append(q4_mm(part, w, bias, cfg=q4_invariant_config(part.shape[0], w)))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def q4_invariant_config(m: int, w: Weight) -> tuple[int, int, int, int, int, int]:
    """`q4_invariant`'s launch shape for m tokens (at most MM_MAX_M): K-blocks of 64 and the split
    `q4_mm_config` takes at 16 tokens, whatever m; tiles of up to 128 tokens."""
    _, _, _, warps, _, split = q4_mm_config(16, w)
    return 64, min(max(16, triton.next_power_of_2(m)), 128), 64, warps, 4 if m <= 128 else 3, split


CHAIN_MAX_M = 8  # tokens `q4_chain` takes (the columns of one MMA)
CHAIN = Fallback("the 4-bit one-token product in CUDA C", twin="Triton's kernel (the same bits)")


def q4_chain_fits(x: Tensor, w: Weight, bias: Tensor | None = None) -> bool:
    """Whether `q4_chain` takes this product: a one-group 4-bit weight of whole 32-row tiles and
    K in 64s, 1 to CHAIN_MAX_M bfloat16 tokens, contiguous from a 16-byte boundary (its inputs are
    copied 16 bytes at a time), a bfloat16 bias if any, on a GPU with bfloat16 tensor-core products
    (compute capability 8.0 and later)."""
    from . import targets

    cc = targets.capability(x.device)
    return (w.q4 and w.group == w.k and x.dtype == torch.bfloat16 and cc is not None and cc >= (8, 0)
            and 1 <= x.shape[0] <= CHAIN_MAX_M and w.n % 32 == 0 and w.k % 64 == 0 and x.is_contiguous()
            and x.data_ptr() % 16 == 0 and (bias is None or bias.dtype == torch.bfloat16))


def invariant_parts(m: int, w: Weight) -> tuple[int, int]:
    """(parts, inputs a part) of K that `q4_invariant` sums separately for m tokens (`q4_mm`'s split
    of its launch shape), which `q4_chain` repeats."""
    _, _, bk, _, _, split = q4_invariant_config(m, w)
    return q4_mm_parts(w, bk, split)[1:]


def chain_whole(m: int, w: Weight, steps: int) -> bool:
    """Whether each part of K that `q4_invariant` cuts for m tokens is whole chunks of `steps`
    16-input steps (q4_chain.cu asserts it; the parts depend on the GPU's SM count)."""
    split, ks = invariant_parts(m, w)
    return all(v % (16 * steps) == 0 for v in (ks, w.k - ks * (split - 1)))


def chain_shape(m: int, w: Weight) -> dict | None:
    """`q4_chain`'s launch shape for m tokens of w where it is faster than `_q4_mm` (sweeps of both
    at Qwen2-7B's shapes on an H200, docs/journal.md; us a call, `_q4_mm` first). One token: a
    weight of many rows (gate/up 42.1 -> 31.4: 32 rows a warp, chunks of 16 steps, three in flight),
    of long rows (down 24.2 -> 16.2: 16 rows, 8 steps, two), of more rows than inputs (q/k/v 9.1 ->
    7.5: 32 rows, four warps a block), else (o 7.9 -> 6.6: 16 rows, 4 steps, four). 2-8 tokens:
    long rows only (down at 8 tokens 24.3 -> 20.6); None elsewhere (gate/up at 8 tokens 41.2
    against 55.7, o 7.9 against 8.3)."""
    if m == 1 and w.n >= 4 * w.k:
        shape = {"rows": 32, "warps": 2, "steps": 16, "stages": 3}
    elif m == 1 and w.k >= 4 * w.n:
        shape = {"rows": 16, "warps": 2, "steps": 8, "stages": 2}
    elif w.k >= 4 * w.n:
        shape = {"rows": 32, "warps": 1, "steps": 8, "stages": 3}
    elif m == 1 and w.n > w.k:
        shape = {"rows": 32, "warps": 4, "steps": 8, "stages": 2}
    elif m == 1:
        shape = {"rows": 16, "warps": 2, "steps": 4, "stages": 4}
    else:
        return None
    return shape if chain_whole(m, w, shape["steps"]) and w.n % shape["rows"] == 0 else None


def chain_defines(m: int, w: Weight, has_bias: bool, pdl: bool, rows: int = 32, warps: int = 4, steps: int = 4,
                  stages: int = 4) -> tuple[tuple[str, int], ...]:
    """The compile-time constants (NVRTC -D) of backends/q4_chain.cu for `q4_chain`: the parts of K
    `q4_invariant` cuts for m tokens, and the launch shape."""
    split, ks = invariant_parts(m, w)
    return (("N", w.n), ("K", w.k), ("KS", ks), ("SPLIT", split), ("MT", triton.next_power_of_2(m)), ("ROWS", rows),
            ("WARPS", warps), ("STEPS", steps), ("STAGES", stages), ("HAS_BIAS", int(has_bias)), ("PDL", int(pdl)))


def q4_chain(x: Tensor, w: Weight, bias: Tensor | None, *, pdl: bool = False, **shape) -> Tensor:
    """`q4_invariant` for 1 to CHAIN_MAX_M tokens (`q4_chain_fits`) on the CUDA C kernel of
    backends/q4_chain.cu: the same bits, its own launch shape (`shape`: rows, warps, steps,
    stages; `chain_shape`'s where it is faster). `pdl`: launched as a programmatic dependent of
    the previous kernel."""
    from .. import cuda

    m = x.shape[0]
    defines = chain_defines(m, w, bias is not None, pdl, **shape)
    split, warps, rows = (dict(defines)[k] for k in ("SPLIT", "WARPS", "ROWS"))
    kernel = cuda.kernel("q4_chain.cu", "q4_chain", x.device, defines)
    tiles = w.n // rows
    y = torch.empty(m, w.n, dtype=x.dtype, device=x.device)
    if split > 1:
        part = torch.empty(tiles * split * 8 * rows, dtype=torch.float32, device=x.device)
        count = _counters(x.device, tiles)
    else:
        part = count = y
    kernel((triton.cdiv(tiles, warps), split), 32 * warps, x, w.w, w.scales, w.zeros,
           bias if bias is not None else y, y, part, count, m, pdl=pdl)
    return y


FALLBACK = Fallback("the 4-bit products")  # (kernels/fallback.py: `q4_eager` where the kernels cannot run)
_NIBBLE = [4 * (j // 2 + 4 * (j % 2)) for j in range(8)]  # value j's nibble in a word (`pair_nibbles`)


def q4_eager(x: Tensor, w: Weight, bias: Tensor | None, rows: int = 4096) -> Tensor:
    """`q4_linear` in torch's own operations, W dequantized `rows` at a time: the eager twin of the
    4-bit products on a GPU where they cannot run (slow: every call dequantizes the weight)."""
    y = torch.empty(x.shape[0], w.n, dtype=x.dtype, device=x.device)
    shifts = torch.tensor(_NIBBLE, dtype=torch.int32, device=x.device)
    words = w.w.transpose(1, 2).reshape(-1, w.k // 8)  # (rows padded to fours, K/8): a row's words
    for n0 in range(0, w.n, rows):
        n1 = min(n0 + rows, w.n)
        q = ((words[n0:n1, :, None] >> shifts) & 0xF).reshape(n1 - n0, -1, w.group).float()  # (rows, groups, GS)
        part = ((q - w.zeros[n0:n1, :, None]) * w.scales[n0:n1, :, None]).reshape(n1 - n0, w.k).to(x.dtype)
        y[:, n0:n1] = x @ part.T
    return y if bias is None else y + bias


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
