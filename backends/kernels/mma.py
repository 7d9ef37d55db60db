"""The batched decode step on the tensor cores, `MMADecode`: `BatchDecode`'s step (batch.py) with
its four projections as matrix products, the step rows the M dimension of `tl.dot`, and
`mma_rows`, one such product (o_proj and down_proj into the residual streams, the TTS code heads).

A program takes BLOCK_M = 16 step rows (rows past nb masked; from `MMADecode.many_from` rows,
`many`'s tiles of 64 rows and columns) and BLOCK_N output columns, loads its weight tile, every
K-block of it, before `wait_previous` (as the single-stream kernels do), then multiplies its rows'
K-blocks in order, float32 accumulation. Fused as decode.py's kernels:

1. `_mma_qkv_rope`: RMSNorm + q/k/v (+ bias) + rotary (the program takes columns d and d + D/2 of
   a head, which the rotation pairs) + k/v into each row's cache row at its own position;
2. attention: `attend_rows` (attention.py), as `BatchDecode`;
3. `_mma_rows`: o_proj + residual, split over K where asked (partials merged in a fixed order by a
   row block's last program, as `_gemv`);
4. `_mma_gate_up`: RMSNorm + gate/up + SiLU(gate) * up;
5. `_mma_rows`: down_proj + residual.

Batch invariance: a row's results are bit for bit the same whatever nb is and whatever the other
rows hold. A tensor-core product computes each output from its own row of A and column of B, and
the K blocking and split are chosen from N and K only (`cfg`), so nb changes only the number and
size of the row and column blocks, which change no bit (measured on an H100: `mma_many`). Unlike
`BatchDecode`, a row's results are not those of the single-stream step (`TritonDecode`): the
RMSNorm's output is rounded to the model dtype before the product, as the eager layer rounds it (a
tensor-core operand is in that dtype), and the sums run in another order.

Dense weights only (bfloat16 on the tensor cores; float32 as float32 products). In Triton's
interpreter the products are summed explicitly (`dot_acc`, common.py).

Tests: tests/test_batch_kernels.py (rows of 17- and 5-row steps against the same rows in 1- and
3-row steps, bit for bit, with their cache writes, on the default tiles and on 32- and 64-row ones;
against the eager decoder; `mma_rows` likewise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import targets
from .batch import BatchDecode
from .common import SplitScratch, Weight, arrive_last, dot_acc, round_to, sum_parts, wait_previous, split_k
from .decode import TritonDecode, load_qkv_bias, rotate_pair, silu_mul

BLOCK_M = 16  # step rows a program, at every nb (batch invariance)


@triton.jit
def _w_tiles(w_ptr, n0, N, k_lo, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KB: tl.constexpr):
    """W[n0.., k_lo..] of W (N, K) as KB tiles (BLOCK_K, BLOCK_N) of its transpose, the B operands
    of a program's products (zeros past N and K)."""
    n = n0 + tl.arange(0, BLOCK_N)
    ws = ()
    for i in tl.static_range(KB):
        k = k_lo + i * BLOCK_K + tl.arange(0, BLOCK_K)
        ws = ws + (tl.load(w_ptr + n[None, :] * K + k[:, None], mask=(n < N)[None, :] & (k < K)[:, None],
                           other=0.0),)
    return ws


@triton.jit
def _inv_rms(x_ptr, m, mm, eps, DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / RMS of rows m (mask mm) of x (rows, DIM), float32 (BLOCK_M,)."""
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in tl.static_range(0, DIM, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + m[:, None] * DIM + k[None, :], mask=mm[:, None] & (k < DIM)[None, :],
                    other=0.0).to(tl.float32)
        ss += tl.sum(v * v, 1)
    return 1.0 / tl.sqrt(ss / DIM + eps)


@triton.jit
def _dots(acc, acc2, x_ptr, g_ptr, inv, m, mm, ws, ws2, k_lo, K: tl.constexpr, BLOCK_K: tl.constexpr,
          KB: tl.constexpr, NORM: tl.constexpr, TWO: tl.constexpr, DOT: tl.constexpr):
    """A program's K loop: acc += A @ ws (and under TWO acc2 += A @ ws2) over its KB K-blocks from
    k_lo, A the rows m of x (rows, K); under NORM RMSNorm(x) (inv from `_inv_rms`, gain g) rounded
    as the eager RMSNorm rounds it: the normalised row, then its product with the gain."""
    dtype = x_ptr.dtype.element_ty
    for i in tl.static_range(KB):
        k = k_lo + i * BLOCK_K + tl.arange(0, BLOCK_K)
        km = k < K
        a = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        if NORM:
            g = tl.load(g_ptr + k, mask=km, other=0.0).to(tl.float32)
            a = (round_to(a.to(tl.float32) * inv[:, None], dtype) * g[None, :]).to(dtype)
        acc = dot_acc(a, ws[i], acc, DOT)
        if TWO:
            acc2 = dot_acc(a, ws2[i], acc2, DOT)
    return acc, acc2


@triton.jit(do_not_specialize=["nb"])
def _mma_qkv_rope(x_ptr, nw_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, eps, max_len, kv_row,
                  nb, DIM: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT: tl.constexpr, PDL: tl.constexpr = False):
    """Program (i, head, j): columns d = j*BLOCK_N.. and d + D/2 of q/k/v head `head` for step rows
    i*BLOCK_M.. of x (rows, DIM), each at its own position (pos_ptr[row]): q to q (rows, HQ*D), k
    and v into cache row `row` (kv_row elements apart) at slot pos."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.program_id(1)
    d0 = tl.program_id(2) * BLOCK_N
    d = d0 + tl.arange(0, BLOCK_N)
    dtype = x_ptr.dtype.element_ty
    KB: tl.constexpr = (DIM + BLOCK_K - 1) // BLOCK_K
    lim = (HQ + 2 * HKV) * D
    ws = _w_tiles(w_ptr, head * D + d0, lim, 0, DIM, BLOCK_N, BLOCK_K, KB)
    ws2 = _w_tiles(w_ptr, head * D + D // 2 + d0, lim, 0, DIM, BLOCK_N, BLOCK_K, KB)
    b1, b2 = load_qkv_bias(b_ptr, head * D + d, head * D + D // 2 + d, HAS_BIAS)
    wait_previous(PDL)
    mm = m < nb
    pos = tl.load(pos_ptr + m, mask=mm, other=0)
    inv = _inv_rms(x_ptr, m, mm, eps, DIM, BLOCK_M, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc, acc2 = _dots(acc, acc2, x_ptr, nw_ptr, inv, m, mm, ws, ws2, 0, DIM, BLOCK_K, KB, True, True, DOT)
    c = round_to(tl.load(cos_ptr + pos[:, None] * D + d[None, :]), dtype)
    s = round_to(tl.load(sin_ptr + pos[:, None] * D + d[None, :]), dtype)
    if HAS_BIAS:
        acc += b1[None, :]
        acc2 += b2[None, :]
    o1, o2 = rotate_pair(round_to(acc, dtype), round_to(acc2, dtype), c, s, head, HQ, HKV, dtype)
    if head < HQ:
        base = q_ptr + m[:, None] * (HQ * D) + head * D
    elif head < HQ + HKV:
        base = kc_ptr + m[:, None] * kv_row + ((head - HQ) * max_len + pos[:, None]) * D
    else:
        base = vc_ptr + m[:, None] * kv_row + ((head - HQ - HKV) * max_len + pos[:, None]) * D
    tl.store(base + d[None, :], o1.to(q_ptr.dtype.element_ty), mask=mm[:, None])
    tl.store(base + D // 2 + d[None, :], o2.to(q_ptr.dtype.element_ty), mask=mm[:, None])


@triton.jit(do_not_specialize=["nb"])
def _mma_gate_up(x_ptr, nw_ptr, w_ptr, h_ptr, eps, nb, DIM: tl.constexpr, INTER: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                 PDL: tl.constexpr = False):
    """Program (i, j): h[rows, n] = silu(gate) * up of RMSNorm(x) for step rows i*BLOCK_M.. and
    columns n = j*BLOCK_N.., W = [gate; up] stacked (2 * INTER, DIM)."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    dtype = x_ptr.dtype.element_ty
    KB: tl.constexpr = (DIM + BLOCK_K - 1) // BLOCK_K
    ws = _w_tiles(w_ptr, n0, INTER, 0, DIM, BLOCK_N, BLOCK_K, KB)
    ws2 = _w_tiles(w_ptr + INTER * DIM, n0, INTER, 0, DIM, BLOCK_N, BLOCK_K, KB)
    wait_previous(PDL)
    mm = m < nb
    inv = _inv_rms(x_ptr, m, mm, eps, DIM, BLOCK_M, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc, acc2 = _dots(acc, acc2, x_ptr, nw_ptr, inv, m, mm, ws, ws2, 0, DIM, BLOCK_K, KB, True, True, DOT)
    h = silu_mul(round_to(acc, dtype), round_to(acc2, dtype), dtype)
    tl.store(h_ptr + m[:, None] * INTER + n[None, :], h.to(dtype), mask=mm[:, None] & (n < INTER)[None, :])


@triton.jit(do_not_specialize=["nb"])
def _mma_rows(y_ptr, w_ptr, x_ptr, out_ptr, part_ptr, cnt_ptr, nb, N: tl.constexpr, K: tl.constexpr,
              RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              SPLIT: tl.constexpr, KS: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr = False):
    """Program (i, j, s): out[rows, n] = y[rows] @ W[n] for step rows i*BLOCK_M.. of y (rows, K) and
    columns n = j*BLOCK_N.. of W (N, K), rounded to y's dtype, plus x[rows, n] (rounded) under
    RESIDUAL; out may be x. Split-K (SPLIT > 1): program s takes inputs s*KS.. and leaves its sums
    in `part`; the row and column block's last program adds them up in a fixed order."""
    mt = tl.program_id(0)
    blk = tl.program_id(1)
    sp = tl.program_id(2)
    tile = mt * tl.num_programs(1) + blk
    m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    KB: tl.constexpr = KS // BLOCK_K
    ws = _w_tiles(w_ptr, blk * BLOCK_N, N, sp * KS, K, BLOCK_N, BLOCK_K, KB)
    wait_previous(PDL)
    mm = m < nb
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc, _ = _dots(acc, acc, y_ptr, y_ptr, 0.0, m, mm, ws, ws, sp * KS, K, BLOCK_K, KB, False, False, DOT)
    if SPLIT == 1:
        _rows_out(acc, y_ptr, x_ptr, out_ptr, m, mm, n, N, RESIDUAL)
    else:
        off = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(part_ptr + (tile * SPLIT + sp) * BLOCK_M * BLOCK_N + off, acc)
        if arrive_last(cnt_ptr + tile, SPLIT):
            t = sum_parts(part_ptr + tile * SPLIT * BLOCK_M * BLOCK_N, off, BLOCK_M * BLOCK_N, SPLIT)
            _rows_out(t, y_ptr, x_ptr, out_ptr, m, mm, n, N, RESIDUAL)
            tl.store(cnt_ptr + tile, 0)


@triton.jit
def _rows_out(t, y_ptr, x_ptr, out_ptr, m, mm, n, N: tl.constexpr, RESIDUAL: tl.constexpr):
    """`_mma_rows`'s outputs from their sums t: rounding, residual."""
    dtype = y_ptr.dtype.element_ty
    msk = mm[:, None] & (n < N)[None, :]
    o = round_to(t, dtype)
    if RESIDUAL:
        o = round_to(tl.load(x_ptr + m[:, None] * N + n[None, :], mask=msk, other=0.0).to(tl.float32) + o, dtype)
    tl.store(out_ptr + m[:, None] * N + n[None, :], o.to(out_ptr.dtype.element_ty), mask=msk)


def _dot_mode(y: Tensor) -> int:
    """`dot_acc`'s DOT for inputs like y: the interpreter where there is no GPU (planned for none)."""
    return 2 if targets.capability(y.device) is None else int(y.dtype == torch.float32)


def mma_rows(w: Weight, y: Tensor, out: Tensor, residual: Tensor | None = None, *, block_n: int = 16,
             block_k: int = 256, split: int = 1, warps: int = 4, scratch: SplitScratch | None = None,
             pdl: bool = False, block_m: int = BLOCK_M) -> Tensor:
    """out[b] = W @ y[b] (+ residual[b]) for the rows of y (nb, K) on the tensor cores, rounded to
    y's dtype; out may be residual. A row's outputs do not depend on nb or on the other rows
    (`block_k` and `split` fixed; `block_m` and `block_n` change no bit: `MMADecode.many`).
    `scratch` for split-K, grown to fit."""
    if w.q4:
        raise ValueError("mma_rows takes dense weights only")
    nb = y.shape[0]
    bk = w.block_k(block_k)
    split, ks = split_k(w.k, bk, split)
    tiles, blocks = triton.cdiv(nb, block_m), triton.cdiv(w.n, block_n)
    if split > 1:
        if scratch is None:
            scratch = SplitScratch(y.device)
        scratch.reserve(tiles * blocks * split * block_m * block_n, tiles * blocks)
        part, count = scratch.part, scratch.count
    else:
        part = count = out
    _mma_rows[(tiles, blocks, split)](y, w.w, residual if residual is not None else out, out, part, count, nb, N=w.n,
                                      K=w.k, RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                                      BLOCK_K=bk, SPLIT=split, KS=ks, DOT=_dot_mode(y), PDL=pdl, num_warps=warps,
                                      launch_pdl=pdl)
    return out


def mma_config(cc: tuple[int, int] | None) -> dict:
    """`MMADecode.cfg` on compute capability cc (kernels/targets.py). On an H200 (tools/batch_step.py,
    ms a step at 16 / 64 / 128 rows): 32 columns a program for all but qkv 0.93 / 2.03 / 3.67, 16 for
    all 0.91 / 2.18 / 3.98, 32 for qkv too 0.96 / 1.99 / 3.64. A program keeps every K-block of its
    weight tiles in shared memory: gate/up's two tiles of 32 columns take 104 KB in bfloat16 for the
    TTS's 768 inputs, over the 99 KB of sm_86, sm_89 and sm_120, where it takes 16."""
    small = cc is not None and targets.limits(cc).smem_block < 160 * targets.KB
    return {"qkv": (16, 256, 4), "o": (32, 256, 2, 4), "gate_up": (16 if small else 32, 256, 4),
            "down": (32, 256, 4, 4), "heads": (32, 256, 1, 4)}


def mma_many(cc: tuple[int, int] | None, dtype: torch.dtype = torch.bfloat16) -> tuple[dict, int | None]:
    """`MMADecode.many` and `many_from` on compute capability cc for weights in `dtype`: from
    `many_from` rows a kernel takes (step rows, output columns, warps) a program. A tensor-core
    product's outputs are the same bits whatever its tile's rows and columns (its K-blocks the same:
    measured on an H100 with tools/batch_step.py --check-tiles), so a row's codes do not depend on
    which is taken. On an H100 (ms a step at 96 / 128 rows, position 350): 16 rows, `mma_config`'s
    columns and warps 2.19 / 2.68; 64 rows 2.13 / 2.53; 64 rows and columns, 8 warps 1.87 / 2.25;
    at 32 and 64 rows no variant won by more than 4%. Only where that was measured, sm_90 (H100,
    H200), and in bfloat16: a program of gate/up keeps its two 64-column weight tiles whole (192 KB
    of the 227 KB a block may take; twice that in float32)."""
    if cc is None or cc[0] != 9 or dtype != torch.bfloat16:
        return {}, None
    return {name: (64, 64, 8) for name in ("qkv", "o", "gate_up", "down", "heads")}, 96


def mma_fits(dtype: torch.dtype, cc: tuple[int, int] | None) -> bool:
    """Whether `MMADecode` fits a block's shared memory for the TTS's sizes: in bfloat16 everywhere;
    in float32 only with the 227 KB of sm_90 and sm_100 (its tiles of every K-block are twice as
    large: 208 KB for gate/up). Elsewhere the TTS runner's batches take `BatchDecode`, which is
    batch-invariant too (each row the single step's arithmetic)."""
    return dtype != torch.float32 or cc is None or targets.limits(cc).smem_block >= 200 * targets.KB


class MMADecode(BatchDecode):
    """`BatchDecode`'s step (same `__call__(x, pos, vis)`, buffers and attention) with the
    projections on the tensor cores (module docstring): a row's results do not depend on its batch,
    but are not bit for bit those of `single` alone.

    `cfg`: per kernel, (output columns a program, K-block[, programs over K for o, down and the
    code heads], warps); the qkv kernel's columns are per half head. The split-K scratch is sized
    here for the most rows (a `cfg` changed later grows it in a graph's warm-up runs, not in its
    capture)."""

    def __init__(self, single: TritonDecode):
        super().__init__(single)
        self.cfg = mma_config(targets.capability(self.x.device))
        self.many, self.many_from = mma_many(targets.capability(self.x.device), self.x.dtype)
        # the split-K scratch (BatchDecode's) for any tiles of 16-128 rows and columns that divide 128
        # (`cfg`'s, `many`'s); others grow it in a graph's warm-up runs, never in its capture
        rows = triton.cdiv(self.rows, 128) * 128
        for name, w in (("o", single.weights[0][1]), ("down", single.weights[0][3])):
            sp = split_k(w.k, w.block_k(self.cfg[name][1]), self.cfg[name][2])[0]
            if sp > 1:
                self.scratch.reserve(rows * triton.cdiv(w.n, 128) * 128 * sp,
                                     triton.cdiv(rows, 16) * triton.cdiv(w.n, 16))

    def tiles(self, name: str, nb: int) -> tuple[int, int, int]:
        """Kernel `name`'s (step rows, output columns, warps) a program for nb rows: `many`'s from
        `many_from` rows, else BLOCK_M rows and `cfg`'s."""
        if self.many_from is not None and nb >= self.many_from and name in self.many:
            return self.many[name]
        return BLOCK_M, self.cfg[name][0], self.cfg[name][-1]

    def _qkv(self, layer, w: Weight, pos: Tensor, nb: int, kv_row: int) -> None:
        s, c, a = self.single, self.c, layer.self_attn
        D, H, Hkv = c.head_dim, c.n_heads, c.n_kv_heads
        bias = a.qkv_proj.bias
        bk = self.cfg["qkv"][1]
        bm, bn, warps = self.tiles("qkv", nb)
        bn = min(bn, D // 2)
        _mma_qkv_rope[(triton.cdiv(nb, bm), H + 2 * Hkv, D // 2 // bn)](
            self.x, layer.input_layernorm.weight, w.w, bias if bias is not None else self.x, s.decoder.rope_cos,
            s.decoder.rope_sin, pos, self.q, a.kv_cache.k, a.kv_cache.v, layer.input_layernorm.eps, s.max_len, kv_row,
            nb, DIM=c.dim, HQ=H, HKV=Hkv, D=D, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_K=w.block_k(bk), DOT=_dot_mode(self.x), PDL=s.pdl, num_warps=warps, launch_pdl=s.pdl)

    def _gate_up(self, layer, w: Weight, nb: int) -> None:
        c, norm, pdl = self.c, layer.post_attention_layernorm, self.single.pdl
        bk = self.cfg["gate_up"][1]
        bm, bn, warps = self.tiles("gate_up", nb)
        _mma_gate_up[(triton.cdiv(nb, bm), triton.cdiv(c.intermediate, bn))](
            self.x, norm.weight, w.w, self.h, norm.eps, nb, DIM=c.dim, INTER=c.intermediate, BLOCK_M=bm,
            BLOCK_N=bn, BLOCK_K=w.block_k(bk), DOT=_dot_mode(self.x), PDL=pdl, num_warps=warps, launch_pdl=pdl)

    def _residual(self, name: str, w: Weight, y: Tensor) -> None:
        x = self.x[: y.shape[0]]
        self._rows(name, w, y, x, x)

    def _rows(self, name: str, w: Weight, y: Tensor, out: Tensor, residual: Tensor | None) -> Tensor:
        bk, sp = self.cfg[name][1:3]
        bm, bn, warps = self.tiles(name, y.shape[0])
        return mma_rows(w, y, out, residual, block_n=bn, block_k=bk, split=sp, warps=warps, scratch=self.scratch,
                        pdl=self.single.pdl, block_m=bm)

    def heads(self, w: Weight, y: Tensor, out: Tensor) -> Tensor:
        """The code heads (`cfg["heads"]`) of rows y (nb, dim) -> out (nb, N), float32."""
        return self._rows("heads", w, y, out, None)
