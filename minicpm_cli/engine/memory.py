"""What a backend needs of a GPU's memory, and what it has: the estimate that `--backend auto`
chooses a backend by and `serve` its rows by, and the cap `MINICPM_MEMORY_CAP` puts on a process.

`need(backend, rows)` estimates, in bytes, the full-size model's weights (the bf16 LLM 15.2 GB,
int4's 4-bit layers 3.3 GB plus its bf16 embeddings and lm_head 2.2 GB; the TTS head and the DVAE
0.44 GB, twice their parameters, Vocos's 0.05 GB in float32 falling in the fixed share below; gguf's
LLM is llama.cpp's, not counted), a fixed share for CUDA graph pools, a prefill's
activations, workspaces and the allocator's slack (1.3 GB: with 1.0, 17 compile rows under a 24 GB
cap and 12 int4 rows under 12 GB ran out of memory), and per row 0.417 GB: its KV caches (the
LLM's 28 layers x 2 x 4 KV heads x 128 x 2 bytes x 4096 slots, 0.23 GB; the TTS's 20 x 2 x 768 x 2
bytes x 2401 slots, 0.15 GB) and its share of the batched steps' buffers and graphs (ROW_WORK: on an
H100, 16 -> 40 replies at once took 0.397 GB a row more of tensors and 0.414 GB more of the
allocator's reserve, which is what a cap bounds). The sizes come from the official model's shapes
(`engine/synthetic.py`'s full spec); docs/benchmarks.md has the measurements under caps.

`available(device)` is what a process may still allocate: the GPU's free memory, or less under
`MINICPM_MEMORY_CAP` (GB), which `apply_cap` turns into torch's per-process fraction, so that a
process behaves as on a card of that size (and runs out of memory as it would there).

No torch at import (the CLI's help imports the registry, which imports this lazily anyway).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import OptionError

if TYPE_CHECKING:
    import torch

GB = 10**9
OVERHEAD = 13 * GB // 10  # graph pools, a prefill's activations, cuBLAS/cuDNN workspaces, the allocator's slack
ROW_WORK = 35 * 10**6  # a row's share of the batched steps' buffers, graphs and allocator blocks (measured)
LLM_CONTEXT = 4096  # (pipeline.LLM_CONTEXT: the LLM's KV slots a row)
TTS_SLOTS = 2401  # (the TTS runner's max_len for the real model: 303 condition slots + 2048 frames + 50)
MAX_ROWS = 16  # rows `serve` takes by default at most (more queue)
CAP = "MINICPM_MEMORY_CAP"


@dataclass(frozen=True)
class Need:
    """Bytes a backend needs: `fixed` once, `per_row` for each row (stream at once)."""

    fixed: int
    per_row: int

    def total(self, rows: int) -> int:
        return self.fixed + rows * self.per_row

    def rows(self, free: int) -> int:
        """Rows that fit in `free` bytes (0: not even one)."""
        return max(0, (free - self.fixed) // self.per_row)


@functools.cache
def _sizes() -> dict[str, int]:
    """Parameter counts of the official model's parts, and its KV bytes a row (bfloat16)."""
    from .synthetic import SyntheticSpec, parameter_count

    s = SyntheticSpec.full()
    llm = parameter_count(s, "llm.")
    layers = parameter_count(s, "llm.model.layers.")
    norms = s.layers * 2 * s.hidden  # (layer norms stay bf16 under int4)
    kv = 2 * 2 * (s.layers * s.kv_heads * (s.hidden // s.heads) * LLM_CONTEXT
                  + s.tts_layers * s.tts_hidden * TTS_SLOTS)
    return {"llm": llm, "quantized": layers - norms, "tts": parameter_count(s, "tts.", include_unused=False),
            "kv": kv}


def element_bytes(dtype: str) -> int:
    """Bytes a weight or cache element takes in `--dtype` (auto on a GPU: bfloat16)."""
    return 4 if dtype in ("float32", "fp32") else 2


def need(backend: str, rows: int = 1, dtype: str = "bfloat16") -> Need:
    """The estimate (module docstring) for `backend` (compile, eager, int4, gguf) in `dtype` (float32
    doubles the weights outside int4's 4-bit layers, and the KV caches)."""
    z, b = _sizes(), element_bytes(dtype)
    rest = b * z["tts"] + OVERHEAD  # the TTS head and codec, graphs, activations
    if backend == "int4":
        llm = b * (z["llm"] - z["quantized"]) + z["quantized"] // 2 + z["quantized"] // 64  # (+ scales, zeros)
    elif backend == "gguf":
        llm = 0  # (llama.cpp's memory: its own, from the GGUF file)
    else:
        llm = b * z["llm"]
    return Need(llm + rest, z["kv"] * b // 2 + ROW_WORK)


def cap_bytes() -> int | None:
    """MINICPM_MEMORY_CAP in bytes (GB, decimal), None when unset."""
    value = os.environ.get(CAP, "").strip()
    if not value:
        return None
    try:
        gb = float(value)
    except ValueError:
        gb = -1.0
    if not math.isfinite(gb) or gb <= 0:
        raise OptionError(f"{CAP}={value!r}: give the GPU memory this process may use, in GB (e.g. 8)")
    return int(gb * GB)


def apply_cap(device: "torch.device") -> None:
    """Hold this process to MINICPM_MEMORY_CAP on `device` (torch's per-process memory fraction; the
    CUDA context itself is outside it); nothing when unset or not a GPU."""
    import torch

    cap = cap_bytes()
    if cap is None or device.type != "cuda":
        return
    device = _indexed(device)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)


def _indexed(device: "torch.device") -> "torch.device":
    """`cuda` as the device it means (the current one): torch's memory fraction takes no other."""
    import torch

    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def available(device: "torch.device") -> int | None:
    """Bytes this process may still allocate on a GPU (MINICPM_MEMORY_CAP applied), None elsewhere."""
    import torch

    if device.type != "cuda":
        return None
    device = _indexed(device)
    apply_cap(device)
    free = torch.cuda.mem_get_info(device)[0]
    cap = cap_bytes()
    return free if cap is None else min(free, cap - torch.cuda.memory_reserved(device))


def rows_for(backend: str, free: int | None, want: int | None = None, most: int = MAX_ROWS,
             dtype: str = "bfloat16") -> int:
    """Rows to make an engine of: `want` (the user's --batch) where it fits, else a one-line error
    saying what does; None: as many as fit, at most `most` (8 where the memory is not known: a CPU).
    gguf: one row (its LLM is one llama.cpp sequence: a batch's streams take turns on it, and more
    rows would only hold TTS caches that no stream can use)."""
    if backend == "gguf":
        want = 1
    if free is None:
        return want or min(8, most)
    est = need(backend, dtype=dtype)
    fit = est.rows(free)
    if fit < 1:
        raise OptionError(too_small(backend, free, dtype))
    if want is None:
        return min(fit, most)
    if want > fit:
        raise OptionError(f"--batch {want} needs about {est.total(want) / GB:.1f} GB of GPU memory with backend "
                          f"'{backend}' and {free / GB:.1f} GB are free: use --batch {fit}"
                          + (" or --backend int4" if _smaller("int4", backend, dtype) else ""))
    return want


def _smaller(other: str, backend: str, dtype: str = "bfloat16") -> bool:
    """Whether `other` needs less memory than `backend` (a hint worth giving)."""
    return need(other, dtype=dtype).total(1) < need(backend, dtype=dtype).total(1)


def too_small(backend: str, free: int, dtype: str = "bfloat16") -> str:
    hint = "try --backend int4" if _smaller("int4", backend, dtype) else "free GPU memory, or run on the CPU (--device cpu)"
    return (f"backend '{backend}' needs about {need(backend, dtype=dtype).total(1) / GB:.1f} GB of GPU memory "
            f"and {free / GB:.1f} GB are free: {hint}")
