"""Single-query attention for one-token steps (`attention_kernel`, launched by `TritonDecode`, decode.py):
a query head against the KV cache's slots up to the position, which is read on the device (one
CUDA graph serves every position), masked causally or by per-slot "visible from" positions (the
TTS chunk mask); the slots are split over programs and merged by the last one to finish. For many
rows at once, `attend_rows`: `rows_attend`, each row's programs as `attention_kernel`'s, or for
query heads that share a KV head (the LLM's) `rows_attend_dot`, the group on the tensor cores, its
own bits. And `prompt_attend`, the batch-invariant mode's attention for prompts (backends/invariant.py).

Tests: tests/test_kernels.py (`test_decode_step_matches_eager_float32`: grouped and plain heads,
causal and masked, cache blocks of 64 and 16 slots; the TTS and LLM runners); tests/test_batch_kernels.py
(`test_grouped_attention_on_the_tensor_cores`: `rows_attend_dot` against `rows_attend`, and its rows
at every row count); tests/test_invariant.py (`prompt_attend` against SDPA, and its rows alone and
batched; the LLM's tokens alone and batched).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRETED, arrive_last, dot_acc, wait_previous


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


def attend_mode(group: int) -> str:
    """`attend_rows`'s kernel for query heads that share a KV head `group` at a time, the same at
    every row count (a row's bits must not depend on it): "head", `rows_attend`, a program a head
    and split (the TTS's heads, a KV head each); "dot", `rows_attend_dot`, the group on the tensor
    cores. On an H100 (tools/attend_sweep.py, the LLM's 28 heads on 4, us a layer at positions
    100 / 350 / 600): 128 rows 52.7 / 81.6 / 116.3 against 170.9 / 312.0 / 438.5; 16 rows 20.2 /
    23.0 / 28.4 against 21.7 / 38.2 / 56.2; one row 10.8 / 11.5 / 12.1 against 5.2 / 6.3 / 7.2."""
    return "dot" if group > 1 else "head"


def attend_rows(q, k_cache, v_cache, vis, pos, out, part, count, *, nb: int, heads: int, splits: int, block_s: int,
                warps: int = 4, pdl: bool = False, mode: str | None = None) -> None:
    """One query a row for rows 0..nb-1: q, out (rows, heads * D); caches (rows, Hkv, max_len, D); pos
    (rows,); vis (rows, max_len) "visible from" positions or None (causal). `mode`: "head" or "dot",
    `attend_mode`'s by default (tests and sweeps choose). part, count: the partials (rows * heads *
    splits * (D + 2) float32) and the splits' counters (rows * heads, int32, zero)."""
    _, hkv, max_len, d = k_cache.shape
    group = heads // hkv
    mode = mode or attend_mode(group)
    args = (q, k_cache, v_cache, vis if vis is not None else pos, pos, out, part, count, d**-0.5, max_len,
            k_cache.stride(0), vis.stride(0) if vis is not None else 1)
    shape = dict(H=heads, SPLITS=splits, GROUP=group, D=d, HAS_VIS=vis is not None, BLOCK_S=block_s, PDL=pdl,
                 num_warps=warps, launch_pdl=pdl)
    if mode == "head":
        rows_attend[(heads, splits, nb)](*args, NB=triton.cdiv(max_len, block_s), **shape)
    elif mode == "dot":
        dot = 2 if INTERPRETED else int(q.dtype == torch.float32)
        rows_attend_dot[(hkv, splits, nb)](*args, GP=max(16, triton.next_power_of_2(group)), DOT=dot, **shape)
    else:
        raise ValueError(f"attention mode must be 'head' or 'dot', got {mode!r}")


@triton.jit
def _attend_head(q_ptr, kc_ptr, vc_ptr, vis_ptr, pos_ptr, out_ptr, part_ptr, cnt_ptr, scale, max_len, h, j,
                 SPLITS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, HAS_VIS: tl.constexpr,
                 BLOCK_S: tl.constexpr, NB: tl.constexpr, PDL: tl.constexpr):
    """The body of `attention_kernel`'s program (h, j)."""
    pos = tl.load(pos_ptr)
    n_blocks = pos // BLOCK_S + 1
    n_used = tl.minimum(n_blocks, SPLITS)
    seen, k, v = _first_block(kc_ptr, vc_ptr, vis_ptr, pos, h // GROUP, j, n_used, max_len, D, HAS_VIS, BLOCK_S)
    wait_previous(PDL)
    if j < n_used:
        _split(q_ptr, kc_ptr, vc_ptr, vis_ptr, pos, part_ptr, scale, max_len, h, j, n_blocks, seen, k, v, SPLITS,
               GROUP, D, HAS_VIS, BLOCK_S, NB)
        if arrive_last(cnt_ptr + h, n_used):
            _merge(part_ptr, out_ptr, h, n_used, SPLITS, D)
            tl.store(cnt_ptr + h, 0)


@triton.jit
def rows_attend_dot(q_ptr, kc_ptr, vc_ptr, vis_ptr, pos_ptr, out_ptr, part_ptr, cnt_ptr, scale, max_len, kv_row,
                    vis_row, H: tl.constexpr, SPLITS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                    HAS_VIS: tl.constexpr, BLOCK_S: tl.constexpr, GP: tl.constexpr, DOT: tl.constexpr,
                    PDL: tl.constexpr = False):
    """The GROUP query heads that share KV head hk as the M side of tensor-core products (padded to
    GP rows): program (hk, j, b) takes row b's blocks j, j + SPLITS, ... up to its position, scores
    Q K^T and P V on the tensor cores (P rounded to the cache's dtype), online softmax in float32,
    and leaves each head's (unnormalised output, max, sum) in `part` as `rows_attend` does; the
    last split to finish merges the group's heads (`_merge_load` for all, then `_merge_store`). Not
    `rows_attend`'s bits: its own, the same whatever the rows beside (a row's products take only its
    own K/V and queries)."""
    hk, j, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_ptr += b * H * D
    kc_ptr += b * kv_row
    vc_ptr += b * kv_row
    vis_ptr += b * vis_row
    out_ptr += b * H * D
    part_ptr += b * H * SPLITS * (D + 2)
    cnt_ptr += b * H
    pos = tl.load(pos_ptr + b)
    n_blocks = pos // BLOCK_S + 1
    n_used = tl.minimum(n_blocks, SPLITS)
    wait_previous(PDL)
    if j < n_used:
        g = tl.arange(0, GP)
        gm = g < GROUP
        dd = tl.arange(0, D)
        q = tl.load(q_ptr + (hk * GROUP + g)[:, None] * D + dd[None, :], mask=gm[:, None], other=0.0)
        m = tl.full([GP], -1e30, dtype=tl.float32)  # (finite: a split whose slots are all hidden)
        acc = tl.zeros([GP, D], dtype=tl.float32)
        total = tl.zeros([GP], dtype=tl.float32)
        for blk in range(j, n_blocks, SPLITS):
            s = blk * BLOCK_S + tl.arange(0, BLOCK_S)
            seen = _seen(s <= pos, s, pos, vis_ptr, HAS_VIS)
            off = (hk * max_len + s)[:, None] * D + dd[None, :]
            k = tl.load(kc_ptr + off, mask=seen[:, None], other=0.0)
            v = tl.load(vc_ptr + off, mask=seen[:, None], other=0.0)
            sc = dot_acc(q, tl.trans(k), tl.zeros([GP, BLOCK_S], dtype=tl.float32), DOT) * scale
            sc = tl.where(seen[None, :], sc, float("-inf"))
            m_new = tl.maximum(tl.max(sc, 1), m)
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m - m_new)
            pv = dot_acc(p.to(v.dtype), v, tl.zeros([GP, D], dtype=tl.float32), DOT)
            acc = acc * alpha[:, None] + pv
            total = total * alpha + tl.sum(p, 1)
            m = m_new
        base = part_ptr + ((hk * GROUP + g) * SPLITS + j) * (D + 2)
        tl.store(base[:, None] + dd[None, :], acc, mask=gm[:, None])
        tl.store(base + D, m, mask=gm)
        tl.store(base + D + 1, total, mask=gm)
        if arrive_last(cnt_ptr + hk * GROUP, n_used):
            # every head's partials requested before the first output is stored: one round trip to
            # L2, not GROUP (a store may alias a later load, so the compiler keeps them in order)
            ms, ls, accs = (), (), ()
            for i in tl.static_range(GROUP):
                m_i, l_i, a_i = _merge_load(part_ptr, hk * GROUP + i, n_used, SPLITS, D)
                ms, ls, accs = ms + (m_i,), ls + (l_i,), accs + (a_i,)
            for i in tl.static_range(GROUP):
                _merge_store(ms[i], ls[i], accs[i], out_ptr, hk * GROUP + i, D)
            tl.store(cnt_ptr + hk * GROUP, 0)


@triton.jit
def _first_block(kc_ptr, vc_ptr, vis_ptr, pos, hk, j, n_used, max_len, D: tl.constexpr, HAS_VIS: tl.constexpr,
                 BLOCK_S: tl.constexpr):
    """Split j's first block of slots: (seen, k, v), K/V of the older slots seen (the current slot's
    come from the previous kernel: `_split` puts them in); nothing seen if the split has none."""
    dd = tl.arange(0, D)
    s = j * BLOCK_S + tl.arange(0, BLOCK_S)
    seen = _seen(s <= tl.where(j < n_used, pos, -1), s, pos, vis_ptr, HAS_VIS)
    older = seen & (s != pos)
    off = (hk * max_len + s)[:, None] * D + dd[None, :]
    k = tl.load(kc_ptr + off, mask=older[:, None], other=0.0).to(tl.float32)
    v = tl.load(vc_ptr + off, mask=older[:, None], other=0.0).to(tl.float32)
    return seen, k, v


@triton.jit
def _split(q_ptr, kc_ptr, vc_ptr, vis_ptr, pos, part_ptr, scale, max_len, h, j, n_blocks, seen, k, v,
           SPLITS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, HAS_VIS: tl.constexpr, BLOCK_S: tl.constexpr,
           NB: tl.constexpr):
    """Split j of head h: online softmax over its first block (`_first_block`'s, the current slot's
    K/V put in here) and every SPLITS-th block after it up to the position's; (unnormalised output,
    max, sum) stored at the split's place in `part`."""
    hk = h // GROUP
    dd = tl.arange(0, D)
    s = j * BLOCK_S + tl.arange(0, BLOCK_S)
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
    base = part_ptr + (h * SPLITS + j) * (D + 2)
    tl.store(base + dd, acc)
    tl.store(base + D, m)
    tl.store(base + D + 1, total)


@triton.jit
def _merge(part_ptr, out_ptr, h, n_used, SPLITS: tl.constexpr, D: tl.constexpr):
    """Head h's output from its n_used splits' partials in `part`, merged in a fixed order (read past
    L1: other programs may have written them)."""
    ms, ls, accs = _merge_load(part_ptr, h, n_used, SPLITS, D)
    _merge_store(ms, ls, accs, out_ptr, h, D)


@triton.jit
def _merge_load(part_ptr, h, n_used, SPLITS: tl.constexpr, D: tl.constexpr):
    """`_merge`'s loads: head h's splits' (max, sum, unnormalised output) from `part`."""
    dd = tl.arange(0, D)
    js = tl.arange(0, triton.next_power_of_2(SPLITS))
    jm = js < n_used
    rows = part_ptr + (h * SPLITS + js) * (D + 2)
    ms = tl.load(rows + D, mask=jm, other=float("-inf"), cache_modifier=".cg")
    ls = tl.load(rows + D + 1, mask=jm, other=0.0, cache_modifier=".cg")
    accs = tl.load(rows[:, None] + dd[None, :], mask=jm[:, None], other=0.0, cache_modifier=".cg")
    return ms, ls, accs


@triton.jit
def _merge_store(ms, ls, accs, out_ptr, h, D: tl.constexpr):
    """`_merge`'s arithmetic on `_merge_load`'s partials, and head h's output stored."""
    dd = tl.arange(0, D)
    w = tl.exp(ms - tl.max(ms, 0))
    y = tl.sum(w[:, None] * accs, 0) / tl.sum(w * ls, 0)
    tl.store(out_ptr + h * D + dd, y.to(out_ptr.dtype.element_ty))


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
