"""The element-wise parts of the batch-invariant token layer (backends/invariant.py, `FusedTokens`),
one launch each where the eager layer takes several, each output bit for bit the eager layer's:

- `rope_write`: the rotary embedding of q and k at each row's position and the writes of k and v
  into the KV cache (eager: some fourteen launches: the products, `rotate_half`'s halves and
  concatenation, the sums, the cache's index writes);
- `silu_mul`: SiLU(gate) * up (eager: three), with torch's SiLU arithmetic (`x / (1 + exp(-x))` in
  float32, IEEE division, the accurate exp);
- `rope_rows`: a prompt's rotary embedding of q and k in place (invariant.py's `FusedPrompt`; the
  cache writes stay the attention's);

with `norm.add_rms_norm` (a residual's addition and the next RMSNorm) they take an LLM layer's
token from some twenty-four launches to nine. Every program reads one row and writes that row's
outputs only, so a row's result does not depend on the others.

Tests: tests/test_invariant.py (the fused layer against the eager one, to the bit).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from .common import INTERPRETED, round_to, wait_previous

# EXACT (a GPU): libdevice's correctly rounded product and accurate exp. The interpreter's libdevice
# has neither; there numpy's plain operators, which neither contract nor approximate.
EXACT = not INTERPRETED


@triton.jit
def _mul(a, b, EXACT: tl.constexpr):
    """a * b rounded to float32, never fused with a following sum (the compiler contracts a product and a
    sum into one FMA even across a round trip through bfloat16: 23% of rotary outputs differed).
    (libdevice's product flushes a subnormal result to zero, which torch's keeps: none arise here.)"""
    if EXACT:
        return libdevice.mul_rn(a, b)
    else:
        return a * b


@triton.jit
def _rotate(y1, y2, c, s, dtype: tl.constexpr, EXACT: tl.constexpr):
    """Paired halves y1, y2 (d and d + D/2) of a q or k head -> x * cos + rotate_half(x) * sin, rounded
    to `dtype` where the eager code's four operations round."""
    a1 = round_to(_mul(y1, c, EXACT), dtype)
    b1 = round_to(_mul(y2, s, EXACT), dtype)
    a2 = round_to(_mul(y2, c, EXACT), dtype)
    b2 = round_to(_mul(y1, s, EXACT), dtype)
    return round_to(a1 - b1, dtype), round_to(a2 + b2, dtype)


@triton.jit
def _rope_write(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, max_len, kv_row,
                HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr = False):
    """Program (head, b): head `head` of row b's q/k/v projection (b, (HQ + 2 HKV) * D), the q and k
    heads rotated by the cos/sin tables (float32, (positions, D)) at the row's position, rounded as
    the eager code rounds them; q heads to q (b, HQ * D), k and v heads into cache row b at the
    position (caches (rows, HKV, max_len, D); kv_row: elements between two rows)."""
    head = tl.program_id(0)
    b = tl.program_id(1)
    dtype = qkv_ptr.dtype.element_ty
    d = tl.arange(0, D // 2)
    wait_previous(PDL)
    pos = tl.load(pos_ptr + b)
    src = qkv_ptr + b * (HQ + 2 * HKV) * D + head * D
    y1 = tl.load(src + d).to(tl.float32)
    y2 = tl.load(src + D // 2 + d).to(tl.float32)
    c = round_to(tl.load(cos_ptr + pos * D + d), dtype)
    s = round_to(tl.load(sin_ptr + pos * D + d), dtype)
    o1 = y1
    o2 = y2
    if head < HQ + HKV:
        o1, o2 = _rotate(y1, y2, c, s, dtype, EXACT)
    if head < HQ:
        dst = q_ptr + b * HQ * D + head * D
    elif head < HQ + HKV:
        dst = kc_ptr + b * kv_row + ((head - HQ) * max_len + pos) * D
    else:
        dst = vc_ptr + b * kv_row + ((head - HQ - HKV) * max_len + pos) * D
    tl.store(dst + d, o1.to(dtype))
    tl.store(dst + D // 2 + d, o2.to(dtype))


@triton.jit
def _rope_rows(qkv_ptr, cos_ptr, sin_ptr, crows, W: tl.constexpr, D: tl.constexpr, EXACT: tl.constexpr):
    """Program (n, head): q or k head `head` of token n's q/k/v projection (a row of W values),
    rotated in place by row n % crows of cos/sin (in the projection's dtype, as the eager code gathers
    them), rounded as the eager code rounds. (Tokens on the grid's first axis: a batch of prompts
    can pass the second's 65535.)"""
    n = tl.program_id(0)
    head = tl.program_id(1)
    dtype = qkv_ptr.dtype.element_ty
    d = tl.arange(0, D // 2)
    src = qkv_ptr + n * W + head * D
    y1 = tl.load(src + d).to(tl.float32)
    y2 = tl.load(src + D // 2 + d).to(tl.float32)
    c = tl.load(cos_ptr + (n % crows) * D + d).to(tl.float32)
    s = tl.load(sin_ptr + (n % crows) * D + d).to(tl.float32)
    o1, o2 = _rotate(y1, y2, c, s, dtype, EXACT)
    tl.store(src + d, o1.to(dtype))
    tl.store(src + D // 2 + d, o2.to(dtype))


def rope_rows(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int, d: int) -> Tensor:
    """A prompt's rotary embedding in place: the first `heads` heads (q's and k's) of each token's
    q/k/v projection qkv (N, W) (contiguous) rotated by cos/sin (R, d) (contiguous, qkv's dtype:
    the rows that `Decoder.forward` gathers; token n takes row n % R), as the eager `Attention.qkv`
    rounds them (eager: ten launches)."""
    n, w = qkv.shape
    _rope_rows[(n, heads)](qkv, cos, sin, cos.shape[0], W=w, D=d, EXACT=EXACT, num_warps=1)
    return qkv


def rope_write(qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, q: Tensor, kv_cache, n_heads: int,
               pdl: bool = False) -> Tensor:
    """qkv (B, (H + 2 Hkv) * D) of rows 0..B-1 at positions pos (B,) -> q (B, H * D) rotated (into
    `q`), k rotated and v written into `kv_cache` rows 0..B-1 at their positions; as the eager
    `Attention.qkv` and `KVCache.write` round them. cos, sin: the float32 tables (positions, D).
    `pdl`: launched as a programmatic dependent of the previous kernel (see `wait_previous`)."""
    rows, hkv, max_len, d = kv_cache.k.shape
    _rope_write[(n_heads + 2 * hkv, qkv.shape[0])](
        qkv, cos, sin, pos, q, kv_cache.k, kv_cache.v, max_len, hkv * max_len * d, HQ=n_heads, HKV=hkv, D=d,
        EXACT=EXACT, PDL=pdl, num_warps=1, launch_pdl=pdl)
    return q


@triton.jit
def _silu_mul(gu_ptr, out_ptr, I: tl.constexpr, BLOCK: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr = False):
    """Program (b, j): out[b, j*BLOCK..] = rnd(rnd(silu(gate)) * up) for gate, up = the halves of row
    b of gu (b, 2 I). (Rows on the grid's first axis: a batch of prompts' tokens can pass the
    second's 65535.)"""
    b = tl.program_id(0)
    j = tl.program_id(1)
    dtype = gu_ptr.dtype.element_ty
    i = j * BLOCK + tl.arange(0, BLOCK)
    m = i < I
    wait_previous(PDL)
    g = tl.load(gu_ptr + b * 2 * I + i, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + b * 2 * I + I + i, mask=m, other=0.0).to(tl.float32)
    if EXACT:  # (tl.exp is the fast approximation on a GPU; torch's is the accurate one)
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    a = round_to(tl.math.div_rn(g, 1.0 + e), dtype)
    tl.store(out_ptr + b * I + i, (a * u).to(dtype), mask=m)


def silu_mul(gu: Tensor, out: Tensor, block: int = 1024, pdl: bool = False) -> Tensor:
    """gu (B, 2 I) -> out (B, I) = SiLU(gate) * up, rounded as the eager `F.silu(gate) * up`. `pdl`:
    launched as a programmatic dependent of the previous kernel (see `wait_previous`)."""
    n = out.shape[-1]
    _silu_mul[(gu.shape[0], triton.cdiv(n, block))](gu, out, I=n, BLOCK=block, EXACT=EXACT, PDL=pdl, num_warps=4,
                                                    launch_pdl=pdl)
    return out
