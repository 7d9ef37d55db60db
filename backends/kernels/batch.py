"""The fused decode step for several rows of the KV cache at once, `BatchDecode`: `TritonDecode`'s
five launches a layer (decode.py) for nb streams, each at its own position with its own "visible
from" row; and `gemv_rows`, the same for one product.

A projection program loads its weight tile, every K-block of it, before `wait_previous`, then
applies it to its step rows one after another (`tl.static_range`; one row a program by default,
which measured fastest: the tiles the other rows' programs read again come from L2) with exactly the arithmetic of the
single-stream kernel: the same K-blocks and products (`dense_mac`), the same sums, split-K merge
and roundings, the same epilogues (`qkv_out`, `gate_up_out`, `gemv_out`). Attention runs
`attention_kernel`'s programs for each row (`attend_rows`). So a row's results are bit for bit those
`TritonDecode` gives it alone, whatever else is in the batch, as long as the two share their K
blocking (`BatchDecode` takes it from the single step's `cfg`): in bfloat16 a batched stream speaks
exactly as it does alone.

Dense weights only (bfloat16, float32): the int4 backend's batches keep the compiled layer halves.

Tests: tests/test_batch_kernels.py (rows at different positions and visibility against each row
alone on `TritonDecode`, bit for bit, float32 and bfloat16, one K-block and several with split-K;
the TTS runner's batched steps against its single steps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .attention import attend_rows
from .common import SplitScratch, Weight, arrive_last, let_next, round_to, sum_parts, wait_previous, split_k
from .decode import TritonDecode, gate_up_out, launch_shape, load_qkv_bias, qkv_out, qkv_store
from .matvec import dense_mac, gemv_out, dense_tile, row_totals, vec


@triton.jit
def _tiles(w_ptr, row0, row02, LIM, k_lo, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
           KB: tl.constexpr, TWO: tl.constexpr):
    """A program's weights: KB K-blocks from k_lo of the rows from row0 and (TWO) row02, as the
    single-stream `_mac` loads them -> (tiles, tiles2), tuples of (BLOCK_R, BLOCK_K) tiles."""
    ws = ()
    ws2 = ()
    for i in tl.static_range(KB):
        ws = ws + (dense_tile(w_ptr, row0, row0, LIM, k_lo + i * BLOCK_K, K, BLOCK_R, BLOCK_K),)
        if TWO:
            ws2 = ws2 + (dense_tile(w_ptr, row02, row0, LIM, k_lo + i * BLOCK_K, K, BLOCK_R, BLOCK_K),)
    if not TWO:
        ws2 = ws
    return ws, ws2


@triton.jit
def _row_k(ws, ws2, v_ptr, g_ptr, k_lo, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
           KB: tl.constexpr, GAIN: tl.constexpr, TWO: tl.constexpr):
    """The dense `k_loop` of one step row (inputs at v_ptr) over a program's tiles -> (acc, acc2,
    ss), element for element what the single-stream loop accumulates."""
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    acc2 = acc
    if TWO:
        acc2 = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in tl.static_range(KB):
        cols = k_lo + i * BLOCK_K + tl.arange(0, BLOCK_K)
        v, ss = vec(v_ptr, g_ptr, cols, cols < K, ss, GAIN)
        acc = dense_mac(acc, ws[i], v)
        if TWO:
            acc2 = dense_mac(acc2, ws2[i], v)
    return acc, acc2, ss


@triton.jit
def _rows_qkv_rope(x_ptr, nw_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, eps, max_len, kv_row,
                   DIM: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, RB: tl.constexpr, PDL: tl.constexpr = False):
    """`_rms_qkv_rope` (decode.py) for step rows: program (head, j, g) takes the single kernel's
    program (head, j) for rows g*RB.. of x (rows, DIM), each at its own position (pos_ptr[b]),
    writing q (rows, HQ*D) and cache row b (kv_row elements apart)."""
    head = tl.program_id(0)
    j = tl.program_id(1)
    b0 = tl.program_id(2) * RB
    dtype = x_ptr.dtype.element_ty
    KB: tl.constexpr = (DIM + BLOCK_K - 1) // BLOCK_K
    d = j * BLOCK_R + tl.arange(0, BLOCK_R)
    row0 = head * D + j * BLOCK_R
    r1 = row0 + tl.arange(0, BLOCK_R)
    ws, ws2 = _tiles(w_ptr, row0, row0 + D // 2, (HQ + 2 * HKV) * D, 0, DIM, BLOCK_R, BLOCK_K, KB, True)
    b1, b2 = load_qkv_bias(b_ptr, r1, r1 + D // 2, HAS_BIAS)
    wait_previous(PDL, False)
    for i in tl.static_range(RB):
        b = b0 + i
        pos = tl.load(pos_ptr + b)
        c = round_to(tl.load(cos_ptr + pos * D + d), dtype)
        s = round_to(tl.load(sin_ptr + pos * D + d), dtype)
        acc1, acc2, ss = _row_k(ws, ws2, x_ptr + b * DIM, nw_ptr, 0, DIM, BLOCK_R, BLOCK_K, KB, True, True)
        o1, o2 = qkv_out(acc1, acc2, ss, ss, 1.0, 0.0, 1.0, 0.0, b1, b2, c, s, head, eps, DIM, HQ, HKV, BLOCK_R,
                          HAS_BIAS, False, DIM, dtype)
        qkv_store(o1, o2, d, head, pos, q_ptr + b * HQ * D, kc_ptr + b * kv_row, vc_ptr + b * kv_row, max_len, HQ,
                   HKV, D)
    let_next(PDL)


@triton.jit
def _rows_gate_up(x_ptr, nw_ptr, w_ptr, h_ptr, eps, DIM: tl.constexpr, INTER: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_K: tl.constexpr, RB: tl.constexpr, PDL: tl.constexpr = False):
    """`rms_gate_up` (decode.py) for step rows: program (i, g) takes the single kernel's program i
    for rows g*RB.. of x (rows, DIM) -> h (rows, INTER)."""
    row0 = tl.program_id(0) * BLOCK_R
    b0 = tl.program_id(1) * RB
    rows = row0 + tl.arange(0, BLOCK_R)
    rm = rows < INTER
    dtype = x_ptr.dtype.element_ty
    KB: tl.constexpr = (DIM + BLOCK_K - 1) // BLOCK_K
    ws, ws2 = _tiles(w_ptr, row0, row0 + INTER, INTER, 0, DIM, BLOCK_R, BLOCK_K, KB, True)
    wait_previous(PDL, False)
    for i in tl.static_range(RB):
        b = b0 + i
        acc_g, acc_u, ss = _row_k(ws, ws2, x_ptr + b * DIM, nw_ptr, 0, DIM, BLOCK_R, BLOCK_K, KB, True, True)
        h = gate_up_out(acc_g, acc_u, ss, ss, 1.0, 0.0, 1.0, 0.0, eps, DIM, BLOCK_R, False, DIM, dtype)
        tl.store(h_ptr + b * INTER + rows, h.to(dtype), mask=rm)
    let_next(PDL)


@triton.jit
def _rows_gemv(y_ptr, w_ptr, x_ptr, out_ptr, part_ptr, cnt_ptr, N: tl.constexpr, K: tl.constexpr,
               RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
               KS: tl.constexpr, RB: tl.constexpr, PDL: tl.constexpr = False):
    """`_gemv` (matvec.py, dense) for step rows: program (i, s, g) takes the single kernel's program
    (i, s) for rows g*RB.. of y (rows, K) -> out (rows, N) (+ x (rows, N)). Split-K: each program
    leaves its partial sums of every row in `part`, and the row block's last program of the group
    merges them row by row, in the single kernel's order."""
    blk = tl.program_id(0)
    sp = tl.program_id(1)
    g = tl.program_id(2)
    blocks = tl.num_programs(0)
    b0 = g * RB
    row0 = blk * BLOCK_R
    r = tl.arange(0, BLOCK_R)
    rows = row0 + r
    rm = rows < N
    dtype = y_ptr.dtype.element_ty
    k_lo = sp * KS
    KB: tl.constexpr = KS // BLOCK_K
    ws, _ = _tiles(w_ptr, row0, row0, N, k_lo, K, BLOCK_R, BLOCK_K, KB, False)
    wait_previous(PDL, False)
    for i in tl.static_range(RB):
        b = b0 + i
        res = 0.0
        if RESIDUAL:
            res = tl.load(x_ptr + b * N + rows, mask=rm, other=0.0).to(tl.float32)
        acc, _, _ = _row_k(ws, ws, y_ptr + b * K, y_ptr, k_lo, K, BLOCK_R, BLOCK_K, KB, False, False)
        t = row_totals(acc, acc, 0.0, K, BLOCK_R, False, K)
        if SPLIT == 1:
            gemv_out(t, 1.0, res, out_ptr + b * N, rows, rm, K, RESIDUAL, False, K, dtype)
        else:
            tl.store(part_ptr + ((b * blocks + blk) * SPLIT + sp) * BLOCK_R + r, t)
    let_next(PDL)
    if SPLIT > 1:
        if arrive_last(cnt_ptr + g * blocks + blk, SPLIT):
            for i in tl.static_range(RB):
                b = b0 + i
                res = 0.0
                if RESIDUAL:
                    res = tl.load(x_ptr + b * N + rows, mask=rm, other=0.0).to(tl.float32)
                t = sum_parts(part_ptr + (b * blocks + blk) * SPLIT * BLOCK_R, r, BLOCK_R, SPLIT)
                gemv_out(t, 1.0, res, out_ptr + b * N, rows, rm, K, RESIDUAL, False, K, dtype)
            tl.store(cnt_ptr + g * blocks + blk, 0)


def _group(nb: int, most: int) -> int:
    """Step rows per program (unrolled in it): all nb up to `most`, else the largest power of two up
    to `most` that divides nb."""
    if nb <= most:
        return nb
    rb = 1 << (most.bit_length() - 1)
    while nb % rb:
        rb //= 2
    return rb


def gemv_rows(w: Weight, y: Tensor, out: Tensor, residual: Tensor | None = None, *, rows: int = 4,
              block_k: int = 512, warps: int = 4, split: int = 1, group: int = 1,
              scratch: SplitScratch | None = None, pdl: bool = False) -> Tensor:
    """out[b] = W @ y[b] (+ residual[b]) for each row of y (nb, K), each row bit
    for bit what `gemv` (matvec.py) gives it with the same block_k and split; out may be residual.
    Programs of `rows` weight rows and `group` step rows; `scratch` for split-K, grown to fit."""
    if w.q4:
        raise ValueError("gemv_rows takes dense weights only")
    nb = y.shape[0]
    rb = _group(nb, group)
    x = residual if residual is not None else out
    bk = w.block_k(block_k)
    split, ks = split_k(w.k, bk, split)
    blocks = triton.cdiv(w.n, rows)
    if split > 1:
        if scratch is None:
            scratch = SplitScratch(y.device)
        scratch.reserve(nb * blocks * split * rows, (nb // rb) * blocks)
        part, count = scratch.part, scratch.count
    else:
        part = count = out
    _rows_gemv[(blocks, split, nb // rb)](y, w.w, x, out, part, count, N=w.n, K=w.k, RESIDUAL=residual is not None,
                                          BLOCK_R=rows, BLOCK_K=bk, SPLIT=split, KS=ks, RB=rb, PDL=pdl,
                                          num_warps=warps, launch_pdl=pdl)
    return out


class BatchDecode:
    """`TritonDecode`'s step (`single`) for rows 0..nb-1 of its decoder's KV cache at once.
    `__call__(x, pos, vis)` takes the input embeddings (nb, dim), the rows' positions (nb,) and,
    for a masked decoder (the TTS), their "visible from" rows (rows, slots); it returns the last
    layer's residual streams (nb, dim), before the final norm, in a static buffer. Row b's result
    and cache writes are bit for bit those of `single` on row b alone (same K blocking: `single.cfg`).
    Positions are read on the device: one CUDA graph per nb serves every position.

    `cfg`: per kernel, (weight rows per program, warps, step rows per program at most); the
    defaults take the single kernels' rows and warps and 1 step row (more are unrolled in a program),
    except down's 4 weight rows: a program keeps its whole tile (every K-block) in registers, and
    8 rows of the TTS's 3072 inputs spilled at 16 step rows (ptxas for sm_90); the rows of a tile do
    not change a row's sums (the K axis keeps its layout). Step rows per program, on an H100
    (tools/batch_step.py --group G, ms a step at nb 4 / 8 / 16): 16 rows - / 1.66 / 4.08, 8 rows
    - / 1.63 / 2.50, 4 rows - / 1.27 / 2.12, 2 rows 0.75 / 1.18 / 1.92, 1 row 0.73 / 1.17 / 1.93: more
    programs in flight beat reading each tile once per step (a tile read again comes from L2).
    `MMADecode` (mma.py) keeps the step and replaces the projections (`_qkv`, `_gate_up`, `_residual`)."""

    def __init__(self, single: TritonDecode, group: int = 1):
        c = single.c
        if any(w.q4 for ws in single.weights for w in ws):
            raise ValueError("BatchDecode takes dense weights only")
        self.single, self.c = single, c
        cache = single.decoder.layers[0].self_attn.kv_cache.k  # (rows, Hkv, slots, D)
        self.rows = cache.shape[0]
        dev, dt = cache.device, cache.dtype
        self.x = torch.zeros(self.rows, c.dim, dtype=dt, device=dev)
        self.q = torch.zeros(self.rows, c.n_heads * c.head_dim, dtype=dt, device=dev)
        self.y = torch.zeros(self.rows, c.n_heads * c.head_dim, dtype=dt, device=dev)
        self.h = torch.zeros(self.rows, c.intermediate, dtype=dt, device=dev)
        self.cfg = {name: (launch_shape(single.cfg[name], 4)[0], launch_shape(single.cfg[name], 4)[2], group)
                    for name in ("qkv", "o", "gate_up", "down")}
        self.cfg["down"] = (min(self.cfg["down"][0], 4),) + self.cfg["down"][1:]
        self.part = torch.zeros(self.rows * c.n_heads * single.max_splits * (c.head_dim + 2), dtype=torch.float32,
                                device=dev)
        self.count = torch.zeros(self.rows * c.n_heads, dtype=torch.int32, device=dev)
        self.scratch = SplitScratch(dev)
        wo, wdown = single.weights[0][1], single.weights[0][3]
        for name, w in (("o", wo), ("down", wdown)):  # sized up front: nothing is allocated in a graph
            sp = split_k(w.k, w.block_k(single.cfg[name][1]), single.cfg[name][4])[0]
            r = self.cfg[name][0]
            if sp > 1:
                self.scratch.reserve(self.rows * triton.cdiv(w.n, r) * sp * r, self.rows * triton.cdiv(w.n, r))

    def __call__(self, x: Tensor, pos: Tensor, vis: Tensor | None = None) -> Tensor:
        s, c, dec = self.single, self.c, self.single.decoder
        nb = x.shape[0]
        if nb > self.rows:
            raise ValueError(f"{type(self).__name__} runs at most {self.rows} rows, got {nb}")
        pdl = s.pdl
        D, H, Hkv = c.head_dim, c.n_heads, c.n_kv_heads
        if x.data_ptr() != self.x.data_ptr():  # (kernels/embed.py writes the step's input in place)
            self.x[:nb].copy_(x)
        splits = min(triton.cdiv(s.max_len, s.block_s), s.max_splits)
        kv_row = Hkv * s.max_len * D
        for layer, (wqkv, wo, wgu, wdown) in zip(dec.layers, s.weights):
            a = layer.self_attn
            self._qkv(layer, wqkv, pos, nb, kv_row)
            attend_rows(self.q, a.kv_cache.k, a.kv_cache.v, vis, pos, self.y, self.part, self.count, nb=nb, heads=H,
                        splits=splits, block_s=s.block_s, warps=s.attn_warps, pdl=pdl,
                        mode="head")  # (each row's attention as `TritonDecode`'s, grouped heads too)
            self._residual("o", wo, self.y[:nb])
            self._gate_up(layer, wgu, nb)
            self._residual("down", wdown, self.h[:nb])
        return self.x[:nb]

    def _qkv(self, layer, w: Weight, pos: Tensor, nb: int, kv_row: int) -> None:
        """RMSNorm, q/k/v and rotary of rows 0..nb-1: q to `q`, k and v into their cache rows."""
        s, c, a = self.single, self.c, layer.self_attn
        D, H, Hkv = c.head_dim, c.n_heads, c.n_kv_heads
        bias = a.qkv_proj.bias
        qr, qw, qg = self.cfg["qkv"]
        qr, qg = min(qr, D // 2), _group(nb, qg)
        _rows_qkv_rope[(H + 2 * Hkv, D // 2 // qr, nb // qg)](
            self.x, layer.input_layernorm.weight, w.w, bias if bias is not None else self.x, s.decoder.rope_cos,
            s.decoder.rope_sin, pos, self.q, a.kv_cache.k, a.kv_cache.v, layer.input_layernorm.eps, s.max_len, kv_row,
            DIM=c.dim, HQ=H, HKV=Hkv, D=D, HAS_BIAS=bias is not None, BLOCK_R=qr,
            BLOCK_K=w.block_k(launch_shape(s.cfg["qkv"], 4)[1]), RB=qg, PDL=s.pdl, num_warps=qw, launch_pdl=s.pdl)

    def _gate_up(self, layer, w: Weight, nb: int) -> None:
        """RMSNorm, gate/up and SiLU(gate) * up of rows 0..nb-1 into `h`."""
        s, c, norm = self.single, self.c, layer.post_attention_layernorm
        gr, gw, gg = self.cfg["gate_up"]
        gg = _group(nb, gg)
        _rows_gate_up[(triton.cdiv(c.intermediate, gr), nb // gg)](
            self.x, norm.weight, w.w, self.h, norm.eps, DIM=c.dim, INTER=c.intermediate, BLOCK_R=gr,
            BLOCK_K=w.block_k(launch_shape(s.cfg["gate_up"], 4)[1]), RB=gg, PDL=s.pdl, num_warps=gw, launch_pdl=s.pdl)

    def _residual(self, name: str, w: Weight, y: Tensor) -> None:
        """o_proj or down_proj of y (nb, K) added to the residual streams in place."""
        _, k, _, _, sp = launch_shape(self.single.cfg[name], 5)[:5]
        r, warps, group = self.cfg[name]
        x = self.x[: y.shape[0]]
        gemv_rows(w, y, x, x, rows=r, block_k=k, warps=warps, split=sp, group=group, scratch=self.scratch,
                  pdl=self.single.pdl)
