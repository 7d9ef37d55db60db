"""The batch-invariant dense product, `invariant_mm`: y = x W^T + b for any number of tokens, each
token's row of y bit for bit the same whatever the other rows are and however many there are.

Why: cuBLAS picks its kernel by shape, and for some shapes (the 7B's o_proj and down_proj: K split
across programs) by the number of rows, so one request's arithmetic changed with the batch it
shared (0 of 16 requests gave the same codes alone and batched in bfloat16). Here every output is
one program's sum over all of K, in order, float32 accumulation on the tensor cores (`tl.dot`, a
chain of 16-wide products), K never split across programs. What changes with the number of tokens
is only how the work is cut (`mm_config`: which rows and tokens a program takes, how much K an
iteration loads, warps and pipelining stages), and none of it changes an output's sums: measured on
an H100 (Triton 3.6), every configuration chosen here gives the same bits for a row, at any offset
in any tile (tests/test_invariant.py checks them at the 7B's shapes on a GPU). One of 86 other
configurations swept for one token did not (which one went unrecorded): a configuration enters
`mm_config` only with that test.

Layout as `_q4_mm` (q4.py): the weight rows are the M side of the product and the tokens the N side
(BLOCK_T of them, padded to at least 16). float32 weights take float32 products ("ieee"); in
Triton's interpreter (the CPU tests) the products are summed explicitly (`dot_acc`): its `tl.dot`
multiplies 16-bit tiles wrongly and sums in an order that depends on the tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import targets
from .common import INTERPRETED, dot_acc, let_next, wait_previous


@triton.jit(do_not_specialize=["M"])  # (one compilation for every token count: none mid-batch)
def _invariant_mm(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, HAS_BIAS: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                  DOT: tl.constexpr, PDL: tl.constexpr = False):
    """Program (i, j): weight rows i*BLOCK_N.. against tokens j*BLOCK_T.. of x (M, K) -> out (M, N):
    the K-blocks in order, one rounding to the output dtype after the bias. (N and K are not
    compile-time constants: one compilation a configuration serves every weight.) Under PDL it waits
    for the previous kernel first and lets the next one in after its K loop (its programs are many:
    let in at once, the next kernel's would take the multiprocessors this one's still need)."""
    pn = tl.program_id(0)
    pt = tl.program_id(1)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    t = pt * BLOCK_T + tl.arange(0, BLOCK_T)
    nm = n < N
    tm = t < M
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    wait_previous(PDL, False)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < K
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        xt = tl.load(x_ptr + t[None, :] * K + k[:, None], mask=tm[None, :] & km[:, None], other=0.0)
        acc = dot_acc(w, xt, acc, DOT)
    let_next(PDL)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + t[None, :] * N + n[:, None], acc.to(out_ptr.dtype.element_ty), mask=nm[:, None] & tm[None, :])


def mm_config(m: int, n: int, k: int, cc: tuple[int, int] | None = None,
              dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_T, BLOCK_K, warps, stages) for m tokens against n weight rows
    of k inputs in `dtype` on compute capability cc (kernels/targets.py; None: the interpreter):
    narrow tiles of rows and long K-blocks for a few tokens (enough programs, and loads
    long enough, to stream the weights at full bandwidth), wide tiles for a prefill (each weight tile
    read by fewer programs). From sweeps at the 7B's shapes in CUDA graphs on an H100
    (docs/journal.md); for 65-128 tokens against the 7B's gate/up (37888 x 3584), 128 x 128 tiles
    read the weights once: 123 us against 200 with 64 x 64 (qkv, o and down stay: 64 x 64 is as
    fast or faster there); 17-32 and 33-64 tokens (a read's prompt) by the 7B's projection
    (`SHORT_PROMPT_TILES`; the prefill of a 51-token prompt 5.71 -> 5.25 ms on an H200); 129-512
    tokens by the 7B's shape (at 256 tokens a layer's four products took 305 us against 443 with one
    shape for all). None of these changes a token's sums
    (tests/test_invariant.py checks every one at the 7B's shapes on a GPU; tools/invariant_sweep.py
    keeps only shapes that give the current bits): the K-blocks are summed in order, each `tl.dot` a
    chain of 16-wide products in order, so K-blocks of 64 or 256 add the same products in the same
    order.

    float32 takes K-blocks of 64 (its sums follow the K-block, measured). Where the shared memory of
    a block is smaller than the configuration's pipeline (`_smem`: 99 KB on sm_86, sm_89 and sm_120;
    float32's tiles on all), it gives up stages first (down to 2), then tokens a program, then rows a
    program; tools/kernel_targets.py compiles what comes out for each architecture."""
    if m <= 16:  # (a long K, down_proj's: narrower tiles, deeper pipelining)
        cfg = (32, 16, 256, 4, 6) if k >= 4 * n else (64, 16, 256, 4, 4)
    elif m <= 64 and n >= 2048 and k >= 2048:  # (a short prompt on the 7B's shapes; the TTS's keep theirs)
        cfg = SHORT_PROMPT_TILES[32 if m <= 32 else 64][_projection(n, k)]
    elif m <= 128:  # (65+ rows of a long product, the 7B's gate/up and lm_head: each weight tile read once)
        cfg = (128, 128, 128, 8, 3) if n >= 4 * k and k >= 2048 else (64, 64, 128, 4, 4)
    elif m <= 512:  # (a prompt's tokens: swept at 256 and 512 on the 7B's shapes, tools/invariant_sweep.py)
        if n >= 4 * k and k >= 2048:  # gate/up: one tile of all the tokens, each weight tile read once
            cfg = 128, 256, 64, 8, 4
        elif k >= 4 * n and n >= 2048:  # down
            cfg = (64, 128, 128, 8, 4) if m <= 256 else (128, 128, 128, 8, 3)
        elif n >= 2048 and k >= 2048 and m <= 256:  # q/k/v, o
            cfg = 64, 128, 64, 8, 4
        else:
            cfg = 128, 128, 64, 8, 3
    else:
        cfg = 128, 256, 64, 8, 4
    bn, bt, bk, warps, stages = cfg
    if dtype == torch.float32:
        bk = 64
    if cc is None:
        return bn, bt, bk, warps, stages
    budget, size = targets.limits(cc).smem_block, torch.finfo(dtype).bits // 8
    while _smem(bn, bt, bk, stages, size, cc) > budget:
        if stages > 2:
            stages -= 1
        elif bt > 16:
            bt //= 2
        else:
            bn //= 2
    return bn, bt, bk, warps, stages


# a short prompt's tiles by projection (`_projection`), for 17-32 and 33-64 tokens: swept on an H200
# (tools/invariant_sweep.py, us a product). At 32 tokens q/k/v 12.3 -> 10.9, o 11.2 -> 9.8, gate/up
# 69.1 -> 66.7, down 49.7 -> 38.7 (lm_head not swept there: its tile before); at 51, o 12.7 -> 10.8,
# down 56.6 -> 47.0, gate/up 78.0 -> 71.6, q/k/v as fast on its tile before, lm_head best on gate/up's
# (262.7 at 64 tokens)
SHORT_PROMPT_TILES = {
    32: {"qkv": (64, 32, 128, 4, 6), "o": (64, 32, 128, 4, 6), "gate_up": (128, 32, 64, 8, 3),
         "down": (32, 32, 256, 4, 6), "lm_head": (64, 32, 128, 4, 4)},
    64: {"qkv": (64, 64, 128, 4, 4), "o": (64, 32, 128, 4, 6), "gate_up": (128, 64, 64, 8, 3),
         "down": (64, 32, 128, 4, 6), "lm_head": (128, 64, 64, 8, 3)},
}


def _projection(n: int, k: int) -> str:
    """Which of the 7B's products a weight (N, K) is shaped like: lm_head (N >= 16 K), gate/up (N >=
    4 K), down (K >= 4 N), q/k/v (K < N < 4 K) or o (the rest)."""
    if n >= 16 * k:
        return "lm_head"
    if n >= 4 * k:
        return "gate_up"
    if k >= 4 * n:
        return "down"
    return "qkv" if n > k else "o"


def _smem(bn: int, bt: int, bk: int, stages: int, size: int, cc: tuple[int, int]) -> int:
    """Shared memory of an `_invariant_mm` program, as Triton 3.x lays it out (measured with
    tools/kernel_targets.py): stages - 1 buffers of a weight and a token tile (on sm_90 and later,
    whose tensor-core path takes more, counted as `stages`), or the output tile on its way to the
    stores, whichever is larger; plus a margin for the rest. The sweep checks what comes out."""
    buffers = stages if cc >= targets.HOPPER else stages - 1
    return max(buffers * (bn + bt) * bk * size, bn * bt * size) + 2 * 1024


def invariant_mm(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None,
                 cfg: tuple | None = None, pdl: bool = False) -> Tensor:
    """x (..., K) @ weight (N, K)^T + bias -> (..., N) in x's dtype; each row of x gets bit for bit
    the same output in any batch. `cfg` overrides `mm_config` (tests, sweeps). `pdl`: launched as a
    programmatic dependent of the previous kernel (see `wait_previous`)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m, k = x2.shape
    nout = weight.shape[0]
    if out is None:
        out = torch.empty(m, nout, dtype=x.dtype, device=x.device)
    if m:
        bn, bt, bk, warps, stages = cfg or mm_config(m, nout, k, targets.capability(x.device), x.dtype)
        if INTERPRETED:  # (its sums: 16 products at a time, in order, as a dot's chain on a GPU)
            bk = 16
        elif x.dtype == torch.float32:  # (float32 products: sums whose order follows the K-block, measured)
            bk = 64
        grid = (triton.cdiv(nout, bn), triton.cdiv(m, bt))
        _invariant_mm[grid](x2, weight, bias if bias is not None else weight, out, m, nout, k,
                            HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_T=bt, BLOCK_K=bk, STAGES=stages,
                            DOT=2 if INTERPRETED else 1 if x.dtype == torch.float32 else 0, PDL=pdl,
                            num_warps=warps, launch_pdl=pdl)
    return out.reshape(*shape[:-1], nout)


def warm(weight: Tensor) -> None:
    """Compile every `mm_config` configuration for weights like `weight` (N, K) now (a first use
    compiles, about a second each, which a batch would otherwise wait for mid-run)."""
    n, k = weight.shape
    for m in sorted({1, 17, 33, 65, 129, 257, 513}):
        invariant_mm(torch.zeros(m, k, dtype=weight.dtype, device=weight.device), weight)
