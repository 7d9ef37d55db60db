"""The GPUs the kernels are built for: each architecture's limits, and the compute capability a
launch plans for (`capability`), which is what chooses between launch configurations
(backends/kernels/configs.py) and turns Hopper-only features on (programmatic dependent launch).

The limits are those of the CUDA C++ Programming Guide, "Compute Capabilities", table "Technical
Specifications per Compute Capability" (CUDA 12.x/13.0 editions): shared memory a block may opt in
to, registers, threads. `capability(device)` is the GPU's own for a CUDA tensor; for tensors on no
GPU it is the target being planned for (`planning`), else None (Triton's interpreter: no limits).
`planning` is how tools/kernel_targets.py launches every kernel of the full-size model on meta
tensors, its Triton driver pointed at one architecture after another, and compiles what they
launch without a GPU (tests/test_targets.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass

import torch

KB = 1024


@dataclass(frozen=True)
class Limits:
    """One compute capability's per-block limits (bytes, registers, threads) and the SM count of a
    representative card (split-K and grid sizes follow it; the compiled kernels do not, but for
    their loop bounds)."""

    name: str
    smem_block: int  # shared memory a block may use, with the opt-in (cudaFuncAttributeMaxDynamicSharedMemorySize)
    smem_static: int = 48 * KB  # statically declared shared memory a block may use (no opt-in)
    regs_thread: int = 255
    regs_block: int = 64 * KB  # 32-bit registers of a block (and of an SM)
    threads_block: int = 1024
    sms: int = 132
    card: str = ""


# The CUDA C++ Programming Guide, "Technical Specifications per Compute Capability": maximum
# shared memory per thread block (opt-in) 96 KB on 7.0, 64 KB on 7.5, 163 KB on 8.0 and 8.7, 99 KB
# on 8.6 and 8.9, 227 KB on 9.0 and 10.0, 99 KB on 12.0; 255 registers per thread, 64 K registers
# per block, 1024 threads per block on all of them. The cards only set the SM count a plan assumes.
# (Volta and Turing have no bfloat16 tensor cores: there the kernels that need them fall back, loudly,
# kernels/fallback.py; their rows keep the plans of the others within the block's shared memory.)
LIMITS: dict[tuple[int, int], Limits] = {
    (7, 0): Limits("sm_70", 96 * KB, sms=80, card="V100"),
    (7, 5): Limits("sm_75", 64 * KB, sms=40, card="T4"),
    (8, 0): Limits("sm_80", 163 * KB, sms=108, card="A100"),
    (8, 6): Limits("sm_86", 99 * KB, sms=82, card="RTX 3090"),
    (8, 7): Limits("sm_87", 163 * KB, sms=16, card="Jetson AGX Orin"),
    (8, 9): Limits("sm_89", 99 * KB, sms=128, card="RTX 4090"),
    (9, 0): Limits("sm_90", 227 * KB, sms=132, card="H100 SXM"),
    (10, 0): Limits("sm_100", 227 * KB, sms=148, card="B200"),
    (12, 0): Limits("sm_120", 99 * KB, sms=170, card="RTX 5090"),
}
TARGETS = ((8, 0), (8, 6), (8, 9), (12, 0), (9, 0))  # what tests/test_targets.py compiles for
HOPPER = (9, 0)  # programmatic dependent launch (griddepcontrol) from here on


def limits(cc: tuple[int, int] | None) -> Limits:
    """The limits of capability cc: its row; for one not in the table, the nearest row below it of
    the same major version, else the row of the smallest shared memory (a plan that fits there
    fits); None (no GPU) reads as sm_90."""
    if cc is None:
        return LIMITS[HOPPER]
    if cc in LIMITS:
        return LIMITS[cc]
    same = [k for k in LIMITS if k[0] == cc[0] and k <= cc]
    row = LIMITS[max(same)] if same else min(LIMITS.values(), key=lambda r: r.smem_block)
    return Limits("sm_%d%d" % cc, row.smem_block, sms=row.sms, card="")


_planned: contextvars.ContextVar[tuple[tuple[int, int], int] | None] = contextvars.ContextVar("planned", default=None)


@contextlib.contextmanager
def planning(cc: tuple[int, int], sms: int | None = None):
    """Inside, launches on tensors that are on no GPU plan for compute capability cc with `sms`
    multiprocessors (default: the representative card's)."""
    token = _planned.set((cc, sms or limits(cc).sms))
    try:
        yield
    finally:
        _planned.reset(token)


def capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability that launches on `device` are planned for: the GPU's; the planned
    one (`planning`) for another device; None where there is neither (the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)
    planned = _planned.get()
    return planned[0] if planned else None


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the GPU (or of the planned one; 132, an H100's, for the
    interpreter)."""
    if device.type == "cuda":
        return _sm_count_cuda(device)
    planned = _planned.get()
    return planned[1] if planned else 132


@functools.cache
def _sm_count_cuda(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def pdl(device: torch.device) -> bool:
    """Whether kernels launch as programmatic dependents of the previous one (`wait_previous`):
    on Hopper and later GPUs; never before them (griddepcontrol is sm_90 PTX), nor in the
    interpreter."""
    cc = capability(device)
    return cc is not None and cc >= HOPPER

