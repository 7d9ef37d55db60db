"""A TTS step's input in one launch (`embed_codes`): each row's last codes through the codebooks'
embeddings, summed, or the audio BOS embedding on a row's first step, written where the step's
first kernel reads it. Eager, the same takes nine launches (four lookups, a stack, a sum, a
`where`, a copy) before the step's first layer: about 19 us of the one-row step's 0.57 ms on an
H100.

The sum is `ChatTTS.embed_codes`'s: the codebooks' rows added in float32 in codebook order, rounded
once to the model dtype (torch's sum of a bfloat16 stack); four bfloat16 values add exactly in
float32, in any order, unless their exponents lie more than 14 apart.

Tests: tests/test_kernels.py (`test_embed_codes_kernel_matches_torch`; the TTS runner on the
kernels against the eager one).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .common import wait_previous


@triton.jit
def _embed_codes(codes_ptr, tables_ptr, bos_ptr, bos_embed_ptr, out_ptr, V, DIM: tl.constexpr, Q: tl.constexpr,
                 BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program b: out[b] = bos_embed if bos[b] else the sum over q of tables[q, codes[b, q]]."""
    b = tl.program_id(0)
    d = tl.arange(0, BLOCK)
    dm = d < DIM
    first = tl.load(bos_embed_ptr + d, mask=dm, other=0.0)
    wait_previous(PDL)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for q in tl.static_range(Q):
        c = tl.load(codes_ptr + b * Q + q)
        acc += tl.load(tables_ptr + (q * V + c) * DIM + d, mask=dm, other=0.0).to(tl.float32)
    x = tl.where(tl.load(bos_ptr + b) != 0, first, acc.to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + b * DIM + d, x, mask=dm)


def embed_codes(codes: Tensor, tables: Tensor, bos: Tensor, bos_embed: Tensor, out: Tensor,
                pdl: bool = False) -> Tensor:
    """codes (nb, Q) integers in 0..V-1 (the kernel does not check them), tables (Q, V, DIM) the
    codebooks' embeddings, bos (nb, 1) bool, bos_embed (DIM,) or (1, DIM) -> out (nb, DIM), each
    row what `torch.where(bos, bos_embed, ChatTTS.embed_codes(codes))` gives it; all contiguous.
    `pdl`: launched as a programmatic dependent of the previous kernel (see `wait_previous`)."""
    if not all(t.is_contiguous() for t in (codes, tables, bos, bos_embed, out)):
        raise ValueError("embed_codes takes contiguous tensors")
    nb, q = codes.shape
    _embed_codes[(nb,)](codes, tables, bos, bos_embed, out, tables.shape[1], DIM=tables.shape[2], Q=q,
                        BLOCK=triton.next_power_of_2(tables.shape[2]), PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out
