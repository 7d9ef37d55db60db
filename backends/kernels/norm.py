"""RMSNorm of one row, or of each of several rows, in one launch (`rms_norm`): the final norm of
the LLM and TTS steps (the norms inside a layer are folded into its projections, decode.py).

Tests: tests/test_kernels.py (the TTS and LLM runners on the kernels against the eager ones).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .common import let_next, round_to, wait_previous


@triton.jit
def _rms_norm(x_ptr, w_ptr, out_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out = w * rnd(x / rms(x)) for row x (N,) of program i, rounded where `RMSNorm` rounds."""
    wait_previous(PDL)
    let_next(PDL)
    i = tl.arange(0, BLOCK)
    m = i < N
    row = tl.program_id(0) * N
    x = tl.load(x_ptr + row + i, mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    h = round_to(x * inv, x_ptr.dtype.element_ty)
    y = h * tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row + i, y.to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: Tensor, norm, out: Tensor, pdl: bool = False) -> Tensor:
    """`norm(x)` (a `RMSNorm`) of x (N,) or of each row of x (rows, N) (contiguous) into out, in one
    launch (the eager module: seven); each row's result is what it gets alone. `pdl`: launched as a
    programmatic dependent of the previous kernel (see `wait_previous`)."""
    n = x.shape[-1]
    _rms_norm[(x.numel() // n,)](x, norm.weight, out, norm.eps, N=n, BLOCK=triton.next_power_of_2(n), PDL=pdl,
                                 num_warps=4, launch_pdl=pdl)
    return out
