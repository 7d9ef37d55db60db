"""Single-query attention for one-token steps (`attention_kernel`, launched by `TritonDecode`, decode.py):
a query head against the KV cache's slots up to the position, which is read on the device (one
CUDA graph serves every position), masked causally or by per-slot "visible from" positions (the
TTS chunk mask); the slots are split over programs and merged by the last one to finish. And
`prompt_attend`, the batch-invariant mode's attention for prompts (backends/invariant.py).

Tests: tests/test_kernels.py (`test_decode_step_matches_eager_float32`: grouped and plain heads,
causal and masked, cache blocks of 64 and 16 slots; the TTS and LLM runners); tests/test_invariant.py
(`prompt_attend` against SDPA, and its rows alone and batched).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import arrive_last, let_next, wait_previous


@triton.jit
def _seen(used, s, pos, vis_ptr, HAS_VIS: tl.constexpr):
    """The slots s of `used` that a query at pos sees (with `vis`, those visible from pos): K/V are
    loaded for those only (a TTS query sees a few of its 300 text slots; the rest, [PAD]s and text
    past its chunk, cost no memory traffic), and `_attend_block` counts those only."""
    if HAS_VIS:
        used = used & (tl.load(vis_ptr + s, mask=used, other=0) <= pos)
    return used


@triton.jit
def _attend_block(q, k, v, seen, m, acc, total, scale):
    """Online softmax over one block of cache slots, those `seen` (`_seen`) counted (k, v (BLOCK_S, D)
    float32, zeros elsewhere)."""
    sc = tl.where(seen, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
    m_new = tl.maximum(tl.max(sc, 0), m)
    p = tl.exp(sc - m_new)
    alpha = tl.exp(m - m_new)
    return m_new, acc * alpha + tl.sum(p[:, None] * v, 0), total * alpha + tl.sum(p, 0)


@triton.jit
def attention_kernel(q_ptr, kc_ptr, vc_ptr, vis_ptr, pos_ptr, out_ptr, part_ptr, cnt_ptr, scale, max_len,
            SPLITS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, HAS_VIS: tl.constexpr,
            BLOCK_S: tl.constexpr, NB: tl.constexpr, PDL: tl.constexpr = False):
    """Program (h, j): query head h against the cache blocks j, j + SPLITS, ... of BLOCK_S slots
    up to the position (split-K "flash decoding", online softmax across a program's blocks); each
    split leaves (unnormalised output, max, sum) in `part`, and the head's last split to finish
    (counted with an atomic, reset for the next step) merges them in a fixed order.

    Only q and the current slot's k/v come from the previous kernel (the q/k/v projection): the
    position (written before the step's first kernel) and the program's first block of older slots
    are loaded before `wait_previous`, so under PDL those loads overlap the previous kernel."""
    _attend_head(q_ptr, kc_ptr, vc_ptr, vis_ptr, pos_ptr, out_ptr, part_ptr, cnt_ptr, scale, max_len, tl.program_id(0),
                 tl.program_id(1), SPLITS, GROUP, D, HAS_VIS, BLOCK_S, NB, PDL)


@triton.jit
def rows_attend(q_ptr, kc_ptr, vc_ptr, vis_ptr, pos_ptr, out_ptr, part_ptr, cnt_ptr, scale, max_len, kv_row, vis_row,
                 H: tl.constexpr, SPLITS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, HAS_VIS: tl.constexpr,
                 BLOCK_S: tl.constexpr, NB: tl.constexpr, PDL: tl.constexpr = False):
    """`attention_kernel` for several rows of the KV cache at once: program (h, j, b) is program (h, j) of
    row b alone (its q, output, cache row, position, "visible from" row, partials and counters), so
    each row's attention is exactly what `attention_kernel` gives it. kv_row, vis_row: elements between
    two cache rows and two rows of `vis`."""
    b = tl.program_id(2)
    _attend_head(q_ptr + b * H * D, kc_ptr + b * kv_row, vc_ptr + b * kv_row, vis_ptr + b * vis_row, pos_ptr + b,
                 out_ptr + b * H * D, part_ptr + b * H * SPLITS * (D + 2), cnt_ptr + b * H, scale, max_len,
                 tl.program_id(0), tl.program_id(1), SPLITS, GROUP, D, HAS_VIS, BLOCK_S, NB, PDL)


@triton.jit
def _attend_head(q_ptr, kc_ptr, vc_ptr, vis_ptr, pos_ptr, out_ptr, part_ptr, cnt_ptr, scale, max_len, h, j,
                 SPLITS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, HAS_VIS: tl.constexpr,
                 BLOCK_S: tl.constexpr, NB: tl.constexpr, PDL: tl.constexpr):
    """The body of `attention_kernel`'s program (h, j)."""
    pos = tl.load(pos_ptr)
    n_blocks = pos // BLOCK_S + 1
    n_used = tl.minimum(n_blocks, SPLITS)
    hk = h // GROUP
    dd = tl.arange(0, D)
    s = j * BLOCK_S + tl.arange(0, BLOCK_S)
    seen = _seen(s <= tl.where(j < n_used, pos, -1), s, pos, vis_ptr, HAS_VIS)  # (none if the split has none)
    older = seen & (s != pos)  # the current slot's K/V come from the previous kernel, below
    off = (hk * max_len + s)[:, None] * D + dd[None, :]
    k = tl.load(kc_ptr + off, mask=older[:, None], other=0.0).to(tl.float32)
    v = tl.load(vc_ptr + off, mask=older[:, None], other=0.0).to(tl.float32)
    wait_previous(PDL)
    if j < n_used:
        q = tl.load(q_ptr + h * D + dd).to(tl.float32)
        now = (s == pos)[:, None]
        k = tl.where(now, tl.load(kc_ptr + (hk * max_len + pos) * D + dd).to(tl.float32)[None, :], k)
        v = tl.where(now, tl.load(vc_ptr + (hk * max_len + pos) * D + dd).to(tl.float32)[None, :], v)
        m, acc, total = _attend_block(q, k, v, seen, -1e30, tl.zeros([D], dtype=tl.float32), 0.0,
                                      scale)  # m: finite even when no slot of the split is seen
        for blk0 in range(SPLITS, NB, SPLITS):  # every SPLITS-th block from j, up to the position's
            if blk0 + j < n_blocks:
                s = (blk0 + j) * BLOCK_S + tl.arange(0, BLOCK_S)
                off = (hk * max_len + s)[:, None] * D + dd[None, :]
                seen = _seen(s <= pos, s, pos, vis_ptr, HAS_VIS)
                k = tl.load(kc_ptr + off, mask=seen[:, None], other=0.0).to(tl.float32)
                v = tl.load(vc_ptr + off, mask=seen[:, None], other=0.0).to(tl.float32)
                m, acc, total = _attend_block(q, k, v, seen, m, acc, total, scale)
        let_next(PDL)
        base = part_ptr + (h * SPLITS + j) * (D + 2)
        tl.store(base + dd, acc)
        tl.store(base + D, m)
        tl.store(base + D + 1, total)
        if arrive_last(cnt_ptr + h, n_used):
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


@triton.jit(do_not_specialize=["row_ptr", "start_ptr", "T", "sq_b", "sq_h", "sq_t", "sc_r", "sc_h", "sc_s", "so_b",
                               "so_t", "so_h"])  # (one compilation for every prompt: none mid-run)
def prompt_attend(q_ptr, kc_ptr, vc_ptr, row_ptr, start_ptr, out_ptr, scale, T,
                  sq_b, sq_h, sq_t, sc_r, sc_h, sc_s, so_b, so_t, so_h,
                  GROUP: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                  PRECISION: tl.constexpr = "tf32"):
    """Causal attention of a prompt's queries over their cache row, the same arithmetic for a query
    whatever else is computed beside it. Program (i, h, b): queries i*BLOCK_T.. of sequence b (head
    h, positions start[b] + t) against cache row row[b] (KV head h // GROUP), blocks of BLOCK_S slots
    from slot 0 up to the block's last query, online softmax in float32. A block holding no slot that
    a query sees leaves that query's max, sum and output exactly as they were (its weights are 0 and
    its rescale 1), so a query's result depends on its position and its row's cache only: not on the
    number of queries, the padding, the sequences beside it or the cache's length. q (B, H, T, D),
    cache (rows, Hkv, S, D), out (B, T, H, D), by strides. PRECISION "ieee" for float32 heads (the
    products in float32, not TF32: 1.6e-3 from SDPA otherwise, H100); bfloat16 ignores it."""
    i, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = tl.load(row_ptr + b)
    start = tl.load(start_ptr + b)
    t = i * BLOCK_T + tl.arange(0, BLOCK_T)
    dd = tl.arange(0, D)
    live = t < T
    q = tl.load(q_ptr + b * sq_b + h * sq_h + t[:, None] * sq_t + dd[None, :], mask=live[:, None], other=0.0)
    pos = start + t
    kv = kc_ptr + row * sc_r + (h // GROUP) * sc_h
    vv = vc_ptr + row * sc_r + (h // GROUP) * sc_h
    m = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    acc = tl.zeros([BLOCK_T, D], dtype=tl.float32)
    end = start + tl.minimum((i + 1) * BLOCK_T, T)  # slots [0, end) are seen by some query here
    for s0 in range(0, end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        inside = (s < end)[:, None]
        k = tl.load(kv + s[:, None] * sc_s + dd[None, :], mask=inside, other=0.0)
        v = tl.load(vv + s[:, None] * sc_s + dd[None, :], mask=inside, other=0.0)
        sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        sc = tl.where(s[None, :] <= pos[:, None], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        p = tl.exp(sc - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    y = acc / total[:, None]
    tl.store(out_ptr + b * so_b + t[:, None] * so_t + h * so_h + dd[None, :], y.to(out_ptr.dtype.element_ty),
             mask=live[:, None])
