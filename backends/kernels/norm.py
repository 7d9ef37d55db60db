"""RMSNorm of one row, or of each of several rows, in one launch (`rms_norm`): the final norm of
the LLM and TTS steps (the norms inside a layer are folded into its projections, decode.py), and
with the residual's addition before it (`add_rms_norm`: the batch-invariant token and prompt layers,
backends/invariant.py). `unit_norm`: each row to unit L2 norm (the speaker vectors of a batch).

Tests: tests/test_kernels.py (the TTS and LLM runners on the kernels against the eager ones);
tests/test_invariant.py (`unit_norm` against `F.normalize`, a row alone and among others).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .common import round_to, wait_previous


@triton.jit
def _rms_norm(x_ptr, w_ptr, out_ptr, eps, r_ptr, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
              HAS_RES: tl.constexpr = False):
    """out = w * rnd(x / rms(x)) for row x (N,) of program i, rounded where `RMSNorm` rounds. With
    HAS_RES, x = rnd(x + r) first, written back to x (the residual stream's `x + r` in its dtype)."""
    wait_previous(PDL)
    i = tl.arange(0, BLOCK)
    m = i < N
    row = tl.program_id(0) * N
    x = tl.load(x_ptr + row + i, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        x = round_to(x + tl.load(r_ptr + row + i, mask=m, other=0.0).to(tl.float32), x_ptr.dtype.element_ty)
        tl.store(x_ptr + row + i, x.to(x_ptr.dtype.element_ty), mask=m)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    h = round_to(x * inv, x_ptr.dtype.element_ty)
    y = h * tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row + i, y.to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: Tensor, norm, out: Tensor, pdl: bool = False) -> Tensor:
    """`norm(x)` (a `RMSNorm`) of x (N,) or of each row of x (rows, N) (contiguous) into out, in one
    launch (the eager module: seven); each row's result is what it gets alone. `pdl`: launched as a
    programmatic dependent of the previous kernel (see `wait_previous`)."""
    n = x.shape[-1]
    _rms_norm[(x.numel() // n,)](x, norm.weight, out, norm.eps, x, N=n, BLOCK=triton.next_power_of_2(n), PDL=pdl,
                                 num_warps=4, launch_pdl=pdl)
    return out


def add_rms_norm(x: Tensor, r: Tensor, norm, out: Tensor, pdl: bool = False) -> Tensor:
    """x += r (in x's dtype, in place), then `rms_norm(x, norm, out)`, in one launch: each row (rows, N)
    bit for bit what the eager `x = x + r; norm(x)` gives it (the same sums as `rms_norm`'s). `pdl`:
    launched as a programmatic dependent of the previous kernel (see `wait_previous`)."""
    n = x.shape[-1]
    _rms_norm[(x.numel() // n,)](x, norm.weight, out, norm.eps, r, N=n, BLOCK=triton.next_power_of_2(n), PDL=pdl,
                                 HAS_RES=True, num_warps=4, launch_pdl=pdl)
    return out


@triton.jit
def _unit_norm(x_ptr, out_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    """out = x / max(||x||, eps) for row x (N,) of program i, rounded where `F.normalize` rounds (the
    norm, an IEEE square root, to the dtype, then the quotient); only the sum's order differs."""
    i = tl.arange(0, BLOCK)
    m = i < N
    row = tl.program_id(0) * N
    x = tl.load(x_ptr + row + i, mask=m, other=0.0).to(tl.float32)
    norm = tl.maximum(round_to(tl.sqrt_rn(tl.sum(x * x, 0)), x_ptr.dtype.element_ty), eps)
    tl.store(out_ptr + row + i, tl.math.div_rn(x, norm).to(out_ptr.dtype.element_ty), mask=m)


def unit_norm(x: Tensor, eps: float, out: Tensor) -> Tensor:
    """Each row of x (rows, N) (contiguous) divided by its L2 norm (at least eps) into out, in one
    launch (`F.normalize`: three); a row's result is what it gets alone."""
    n = x.shape[-1]
    _unit_norm[(x.numel() // n,)](x, out, eps, N=n, BLOCK=triton.next_power_of_2(n), num_warps=4)
    return out
