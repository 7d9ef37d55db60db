"""Choosing a backend and loading a model by name: what `say`, `bulk`, `serve` (here and in a Ray
Serve replica), `bench` and the tools share before a `Synthesizer` exists.

`pick` turns the user's `--backend` (a name or `auto`) and `--model` (or none: the backend's default)
into what to load, failing loudly on an unknown name or a missing extra; `load` loads it.
`environment` records where a run happened (device, driver, versions, commit) for benchmark results
and a server's `/props`. With random weights the lengths are forced (`FORCED_*`): a random LLM never
ends its reply and a random TTS never emits EOS, so `bench --random-weights` and
`serve --random-weights` fix them to these numbers.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from .. import backends as registry
from ..errors import OptionError

if TYPE_CHECKING:
    import torch

    from .pipeline import Synthesizer

FORCED_REPLY_TOKENS = 24  # LLM tokens in a reply with random weights
FORCED_FRAMES_PER_TOKEN = 10  # audio frames per TTS text token with random weights (EOS ignored)


def check_gguf(backend: str, gguf: Optional[str]) -> None:
    """--gguf names the gguf backend's file: refused with any other backend (`backend` may list several)."""
    if gguf is not None and not {"gguf", registry.AUTO} & set(backend.split(",")):
        raise OptionError("--gguf is for --backend gguf")


def pick(model: Optional[str], backend: str, device: str, gguf: Optional[str],
         dtype: str = "auto") -> tuple[str, str]:
    """(the backend `auto` stands for here, the model to load: the backend's default when none is given).
    On a GPU `auto` weighs what is free (engine/memory.py, MINICPM_MEMORY_CAP applied)."""
    check_gguf(backend, gguf)
    if backend == registry.AUTO:  # (only here is torch imported: a named backend's helper starts before it)
        from . import memory
        from .pipeline import resolve_device

        dev = resolve_device(device)
        free = memory.available(dev)
        backend = registry.choose(model, dev.type, gguf=gguf, free=free, dtype=dtype)
        if backend == "int4" and free is not None and memory.need("compile", dtype=dtype).rows(free) < 1 \
                and model is None:
            print(f"minicpm: {free / memory.GB:.1f} GB of GPU memory free, too little for the "
                  f"{'float32' if memory.element_bytes(dtype) > 2 else 'bf16'} model: using "
                  f"--backend int4 ({registry.get('int4').default_model}, about 6 GB, downloaded once)",
                  file=sys.stderr, flush=True)
    be = registry.get(backend)
    be.check()
    return backend, model or be.default_model


def load(model: Optional[str], backend: str, device: str, dtype: str, gguf: Optional[str] = None, *,
         rows: Optional[int] = 1, random_weights: bool = False,
         batch_invariant: bool = True, most_rows: Optional[int] = None) -> tuple["Synthesizer", str, str]:
    """(the loaded synthesizer, the backend name chosen, the model it was loaded from), `rows` streams
    at once (0 or None: as many as the GPU's free memory holds, at most `most_rows`, by default
    memory.MAX_ROWS; rows that do not fit: a one-line error naming what does; engine/memory.py).
    With `random_weights` the full-size model is drawn on the device (`model` unused);
    `batch_invariant`: see `Synthesizer.load`."""
    from . import warmstart

    be = registry.REGISTRY.get(backend)  # (None: auto, or a name that `pick` refuses)
    warmstart.begin(be.triton if be else backend == registry.AUTO and gguf is None, device)  # (before torch)
    name, model_id = pick(model, backend, device, gguf, dtype)  # (auto imports torch; a named backend, nothing)
    _precompile(name, None if random_weights else model_id, device, dtype, batch_invariant, rows)  # (checked)
    from . import memory
    from .pipeline import Synthesizer, resolve_device

    rows = memory.rows_for(name, memory.available(resolve_device(device)), rows or None, most_rows or memory.MAX_ROWS,
                           dtype)

    synth = Synthesizer.load(model if random_weights else model_id, backend=name, device=device, dtype=dtype,
                             gguf=gguf, random_weights=random_weights, rows=rows, batch_invariant=batch_invariant)
    return synth, name, model_id


def _precompile(backend: str, model: Optional[str], device: str, dtype: str, invariant: bool,
                rows: Optional[int]) -> None:
    """The backend's Triton kernels compiled side by side while it loads, where Triton's cache lacks
    them (backends/kernels/precompile.py); `model` None: the full-size random one; `rows` 1: one
    stream (`say`), whose batched steps run at one row only."""
    from ..backends.kernels import precompile

    helper = precompile.start(backend, device, dtype, invariant=invariant, model=model, rows=rows)
    if helper is not None:
        precompile.wait_before_compiling(helper)


def environment(device: "torch.device") -> dict:
    """Where a run happens: date, Python, torch, CUDA, the device's name and driver, the commit."""
    import torch

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "device": "cpu", "driver": None, "commit": None}
    if device.type == "cuda":
        env["device"] = torch.cuda.get_device_name(device)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=10).stdout.split("\n")[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    else:
        env["device"] = platform.processor() or platform.machine()
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    # a copied tree (e.g. on a remote GPU machine) may have no .git, or a stale one: the caller's
    # MINICPM_COMMIT, when set, says which commit it is
    env["commit"] = os.environ.get("MINICPM_COMMIT") or env["commit"] or None
    return env
