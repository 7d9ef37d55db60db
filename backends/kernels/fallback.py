"""A kernel that cannot be compiled or launched on this GPU: its stage runs the eager path instead,
and says so once, on stderr.

`Fallback(stage)` guards one stage's kernel path: `guard(kernel, eager, device)` calls `kernel()`;
if a kernel in it fails as a kernel fails on a GPU it was not tuned for (Triton's OutOfResources,
a compilation or ptxas error, the CUDA C kernel's NVRTC or driver error, a launch that asks for
more than the GPU has), the stage warns once, naming the kernel and the GPU, and calls `eager()`
then and on every later call. Anything else is raised as it is. Stages are the TTS and LLM
runners' one-token steps, their batched steps, and the batch-invariant products, norms and
attention (backends/invariant.py); int4's 4-bit products (backends/gptq.py). An eager path gives
what the eager backend gives, to its rounding: a batch-invariant stage that falls back is no longer
batch-invariant, which the warning says.

This is the one deliberate exception to "backends fail loudly, never fall back silently"
(docs/design.md): the fallback is loud, once, and per stage, and a command that would otherwise
fail on a GPU nobody has tested succeeds. tests/test_targets.py checks ahead of time that every
configuration fits the GPUs of kernels/targets.py; this is for the rest.

`events()` counts the fallbacks so far: a CUDA graph whose capture failed while one happened is
captured again, on the eager path (backends/compile.py `Graphs`).

Tests: tests/test_fallback.py (kernels made to fail in Triton's interpreter: the same output as
eager, one warning line).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from . import targets

_warned: set[tuple[str, str]] = set()
_events = [0]


def events() -> int:
    """How many stages have fallen back so far in this process."""
    return _events[0]


def is_failure(e: BaseException) -> bool:
    """Whether e is a kernel that cannot run on this GPU (not a bug of ours elsewhere, which is raised)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources, PTXASError

    from ..cuda import KernelError

    if isinstance(e, (OutOfResources, PTXASError, CompilationError, KernelError)):
        return True
    # a launch the GPU refuses ("too many resources requested for launch"): Triton's launcher's error
    return isinstance(e, RuntimeError) and str(e).startswith("Triton Error [CUDA]") and "resources" in str(e)


def kernel_name(e: BaseException) -> str:
    """The kernel whose launch raised e: the JIT function whose launch (`run`, or a launcher standing
    for one) is on the traceback, else what the error says (the CUDA C kernel's `kernel`)."""
    name = getattr(e, "kernel", None)
    tb = e.__traceback__
    while tb is not None:
        fn = getattr(tb.tb_frame.f_locals.get("self"), "fn", None)
        if callable(fn) and hasattr(fn, "__name__") and tb.tb_frame.f_code.co_name in ("run", "launch", "<lambda>"):
            name = fn.__name__
            break
        tb = tb.tb_next
    return name or type(e).__name__


def gpu_name(device: torch.device) -> str:
    """'NVIDIA GeForce RTX 3090 (sm_86)', or the device's type where it is no GPU."""
    if device.type != "cuda":
        return str(device)
    cc = targets.capability(device)
    return f"{torch.cuda.get_device_name(device)} (sm_{cc[0]}{cc[1]})"


class Fallback:
    """One stage's choice between its kernels and its eager path (module docstring)."""

    def __init__(self, stage: str, twin: str | None = None):
        """`twin`: what the stage runs instead where that is not the eager path (a kernel that gives
        the same output, so the stage stays batch-invariant)."""
        self.stage, self.twin = stage, twin
        self.failed = False

    def guard(self, kernel: Callable, eager: Callable, device: torch.device):
        if not self.failed:
            try:
                return kernel()
            except Exception as e:
                if not is_failure(e):
                    raise
                self.fail(e, device)
        return eager()

    def fail(self, e: BaseException, device: torch.device) -> None:
        self.failed = True
        _events[0] += 1
        name = kernel_name(e)
        if (name, self.stage) in _warned:
            return
        _warned.add((name, self.stage))
        why = " ".join(str(e).split()) or type(e).__name__
        instead = (f"on {self.twin} from now on (slower)" if self.twin
                   else "on the eager path from now on (slower, and not batch-invariant)")
        print(f"minicpm: warning: kernel {name} cannot run on {gpu_name(device)} ({why[:200]}): {self.stage} runs "
              f"{instead}", file=sys.stderr, flush=True)
