"""What the kernels share: programmatic dependent launch (`wait_previous`, `let_next`), split-K
counting and merging (`arrive_last`, `sum_parts`, `SplitScratch`, `split_k`), a tile product
accumulated three ways (`dot_acc`), rounding to the model dtype (`round_to`), the projection weight as the kernels take it (`Weight`) and the GPU's SM count.

On Hopper and later GPUs the decode steps' kernels (the TTS step's, the LLM token's: the Triton
decode kernels, and the batch-invariant token layer where its products are `invariant_mm`) launch
as programmatic dependents: each may load what no kernel of the step writes (its first weights),
then waits in `wait_previous`.

Tested through the kernels that use them (tests/test_kernels.py, tests/test_int4_kernels.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import targets


# Triton's interpreter runs the kernels (the CPU tests; read when a kernel module is imported)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def wait_previous(PDL: tl.constexpr, LET_NEXT: tl.constexpr = True):
    """Under programmatic dependent launch (PDL, Hopper and later: a kernel of the step may start
    while the previous one finishes): wait until the previous kernel has finished and its writes
    are visible. Before this a kernel may only read what no kernel of the step writes (weights).
    Then (LET_NEXT) the next kernel may start at once: its programs load their weights while this
    one works, and wait for it in their own `wait_previous` (on an H100, the tensor-core TTS step
    of one row 0.588 -> 0.487 ms against letting it in after the products, docs/journal.md). The
    kernels that stream their weights in a K loop (matvec.py, decode.py, gemm.py's `invariant_mm`)
    and the row-by-row batched ones (batch.py) let it in after their products instead (`let_next`):
    early, `BatchDecode` at 16 rows took 1.897 ms against 1.714."""
    if PDL:
        gdc_wait()
        if LET_NEXT:
            gdc_launch_dependents()


@triton.jit
def let_next(PDL: tl.constexpr):
    """Under PDL, in a kernel whose `wait_previous` did not let the next kernel in: once every
    program of this kernel has come here, the next kernel may start (its programs load their first
    weights, then wait in `wait_previous`)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def arrive_last(cnt_ptr, n):
    """Split-K: after this program's partial results are stored, count it in at cnt_ptr; True for
    the last of the n programs to arrive, which then merges the partials and resets the count."""
    tl.debug_barrier()  # every thread's partials are written before the count goes up
    return tl.atomic_add(cnt_ptr, 1, sem="acq_rel") == n - 1


@triton.jit
def sum_parts(part_ptr, offs, SIZE: tl.constexpr, SPLIT: tl.constexpr):
    """Split-K: the SPLIT partial sums stored at part_ptr + j * SIZE + offs, added in a fixed order
    (read past L1: other programs wrote them)."""
    t = tl.load(part_ptr + offs, cache_modifier=".cg")
    for j in tl.static_range(1, SPLIT):
        t += tl.load(part_ptr + j * SIZE + offs, cache_modifier=".cg")
    return t


@triton.jit
def dot_acc(a, w, acc, DOT: tl.constexpr):
    """acc += a @ w: on the tensor cores (DOT 0); as float32 products (1: float32 weights); as
    float32 products summed explicitly (2: Triton's interpreter, whose `tl.dot` multiplies bfloat16
    tiles as their raw bits and sums a row of float32 ones in an order that depends on its place in
    the tile: numpy's matmul)."""
    if DOT == 0:
        acc = tl.dot(a, w, acc)
    elif DOT == 1:
        acc = tl.dot(a, w, acc, input_precision="ieee")
    else:
        acc += tl.sum(a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], 1)
    return acc


@triton.jit
def round_to(v, dtype: tl.constexpr):
    """Round a float32 value to the model dtype (and back), as an eager op's output would be."""
    return v.to(dtype).to(tl.float32)


class Weight:
    """A projection's weight as the kernels take it: dense (N, K), or 4-bit (`q4`, see `_mac`)."""

    def __init__(self, w: Tensor, scales: Tensor | None = None, zeros: Tensor | None = None, group: int = 0):
        """Dense: w (N, K). 4-bit: w int32 (ceil(N/4), K/8, 4) (see `_mac`), float32 scales and
        zeros (N, groups), `group` inputs per group."""
        self.w, self.scales, self.zeros = w, scales, zeros
        self.q4 = scales is not None
        self.n = scales.shape[0] if self.q4 else w.shape[0]
        self.k = w.shape[1] * 8 if self.q4 else w.shape[1]
        self.group = group if self.q4 else self.k
        if self.q4 and (w.dim() != 3 or w.shape[2] != 4 or w.shape[0] * 4 < self.n):
            raise ValueError(f"4-bit weight words must be (ceil(N/4), K/8, 4), got {tuple(w.shape)} for N={self.n}")

    @classmethod
    def of(cls, linear) -> Weight:
        """From an nn.Linear, or anything with a `kernel_weight()` (backends/int4.py's Q4Linear)."""
        return linear.kernel_weight() if hasattr(linear, "kernel_weight") else cls(linear.weight)

    def args(self) -> tuple:
        s = self.scales if self.q4 else self.w
        return self.w, s, self.zeros if self.q4 else self.w

    def block_k(self, want: int) -> int:
        """K per iteration: a power of two."""
        return min(want, triton.next_power_of_2(self.k))

    def vw(self, want: int) -> int:
        """Accumulator columns for that K block (a 4-bit word's eight values share one)."""
        return self.block_k(want) // (8 if self.q4 else 1)


class SplitScratch:
    """Partial sums and counters for split-K `gemv` calls (zeroed counters; each call leaves them
    zeroed). One serves any number of calls in stream order."""

    def __init__(self, device, sums: int = 0, blocks: int = 0):
        self.device, self.part, self.count = device, None, None
        self.reserve(sums, blocks)

    def reserve(self, sums: int, blocks: int) -> None:
        if self.part is None or self.part.numel() < sums:
            self.part = torch.zeros(max(sums, 1), dtype=torch.float32, device=self.device)
        if self.count is None or self.count.numel() < blocks:
            self.count = torch.zeros(max(blocks, 1), dtype=torch.int32, device=self.device)


def split_k(k: int, bk: int, split: int) -> tuple[int, int]:
    """(programs per output block, inputs each) of a split-K product over k inputs in blocks of bk:
    the blocks shared out evenly over at most `split` programs."""
    ks = triton.cdiv(triton.cdiv(k, bk), max(split, 1)) * bk
    return triton.cdiv(k, ks), ks


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a GPU, which the prefill product aims to fill (132 on an H100
    or H200, also assumed for a CPU: the interpreter; a planned GPU's, targets.py)."""
    return targets.sm_count(device)
