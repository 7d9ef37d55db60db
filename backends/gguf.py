"""`gguf`: llama.cpp runs the LLM stage from a GGUF file; the TTS head, DVAE and Vocos stay ours.

The GGUF holds MiniCPM-o 2.6's LLM as a `qwen2` model (OpenBMB's files, or ones written by
`minicpm_cli.engine.gguf_export`). Token ids come from our tokenizer, so every backend sees the same ids.
Each `forward` appends the ids to llama.cpp's KV cache in one batch and reads back the last token's
logits and every token's output embedding, which for a causal model is the post-final-norm hidden
state (what the TTS takes its speaker vector from). A voice's audio embeddings go in as batches of
input embeddings (llama.cpp's `embd`) between the batches of token ids around them. Sampling stays in
`minicpm_cli.engine.llm`, so `--greedy` and the sampling options mean the same on every backend.
llama-cpp-python is imported when the backend is created (the `gguf` extra).

Cost: the `gguf` extra (llama-cpp-python; a CUDA build for the GPU) and a GGUF file of the LLM (the
official Q4_K_M one is about a third of bf16's size, and llama.cpp holds it on the GPU); the LLM
decodes at llama.cpp's speed, the TTS head and codec run as on compile. A quantized file's output is
close to, not equal to, the bf16 model's. The LLM runs one request at a time (never batched), the TTS
head and codec on compile's batch-invariant kernels; llama.cpp's own rounding was not measured.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from minicpm_cli.errors import BackendError, ModelNotFound, UsageError

from . import compile as compiled

DEFAULT_REPO = "openbmb/MiniCPM-o-2_6-gguf"
DEFAULT_FILE = "Model-7.6B-Q4_K_M.gguf"


def resolve_gguf(spec: str | None) -> Path:
    """A local GGUF file (any name; checked by its magic), or `REPO:FILE` / `REPO` (default file)
    fetched into the HF cache. A spec that names no file here and looks like a path (a `.gguf` name,
    a directory part, `~`) is a file not found, not a repository."""
    spec = spec or f"{DEFAULT_REPO}:{DEFAULT_FILE}"
    path = Path(spec).expanduser()
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise UsageError(f"{spec} is not a GGUF file (a .gguf model file, or REPO[:FILE] on the hub)")
        return path
    if path.is_dir():
        raise UsageError(f"{spec} is a directory: --gguf takes a .gguf file, or REPO[:FILE] on the hub")
    if ":" not in spec and (spec.endswith(".gguf") or spec.startswith((".", "~", "/")) or spec.count("/") > 1):
        raise ModelNotFound(f"GGUF file not found: {spec}")
    repo, _, name = spec.partition(":")
    from ..engine.checkpoint import hub_file

    return hub_file(repo, name or DEFAULT_FILE)


def _gpu_used() -> int:
    """Device memory in use outside torch's allocator (what torch holds, on other threads too, is not
    llama.cpp's)."""
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


class GGUFLLM:
    name = "gguf"

    def __init__(self, path: Path, max_len: int, device: torch.device):
        gpu = device.type == "cuda"
        self.device = device
        import llama_cpp

        self.lib = llama_cpp
        used = _gpu_used() if gpu else 0
        try:
            # float32 KV cache: llama.cpp's default f16 cache moved hidden states by ~1e-3 (measured)
            self.llama = llama_cpp.Llama(model_path=str(path), n_ctx=max_len, n_batch=max_len, n_ubatch=512,
                                         n_gpu_layers=-1 if gpu else 0, embedding=True, verbose=False,
                                         # on the CPU, a CUDA build must not move big batches to the GPU
                                         op_offload=gpu, offload_kqv=gpu,
                                         type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
        except (ValueError, RuntimeError) as e:
            raise BackendError(f"backend 'gguf': llama.cpp cannot load {path}: {e}") from None
        self.ctx = self.llama._ctx.ctx
        self.n_embd = self.llama.n_embd()
        self.n_vocab = self.llama.n_vocab()
        self.max_len = max_len
        self.batch = llama_cpp.llama_batch_init(max_len, 0, 1)
        self.pos = 0
        self.version = f"llama-cpp-python {llama_cpp.__version__}"
        self.weight_bytes = os.path.getsize(path)
        # GPU memory llama.cpp holds (weights, KV cache, compute buffers), which torch does not see
        self.extra_gpu_bytes = _gpu_used() - used if gpu else 0

    def reset(self) -> None:
        mem = self.lib.llama_get_memory(self.ctx)
        self.lib.llama_memory_clear(mem, True)
        self.pos = 0

    # One LLM stream (one llama.cpp sequence): a batch over this backend has one row (`rows`), so
    # its streams' LLM work takes turns; the row interface is the single stream's.
    rows = 1

    def reset_row(self, row: int) -> None:
        self.reset()

    def forward_row(self, row: int, ids: list[int], embeds: Tensor | None = None,
                    embed_at: list[int] | None = None) -> tuple[Tensor, Tensor]:
        return self.forward(ids, embeds, embed_at)

    def save_prefix_row(self, row: int) -> "Prefix":
        return self.save_prefix()

    def load_prefix_row(self, row: int, prefix: "Prefix") -> None:
        self.load_prefix(prefix)

    def save_prefix(self) -> "Prefix":
        """The sequence's context so far, as llama.cpp serialises one sequence (its KV cells)."""
        size = self.lib.llama_state_seq_get_size(self.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        written = self.lib.llama_state_seq_get_data(self.ctx, buf, size, 0)
        if written != size:
            raise BackendError(f"backend 'gguf': llama.cpp saved {written} of {size} bytes of a context")
        return Prefix(self.pos, bytes(buf))

    def load_prefix(self, prefix: "Prefix") -> None:
        self.reset()
        data = (ctypes.c_uint8 * len(prefix.state)).from_buffer_copy(prefix.state)
        if self.lib.llama_state_seq_set_data(self.ctx, data, len(prefix.state), 0) != len(prefix.state):
            raise BackendError("backend 'gguf': llama.cpp could not restore a saved context")
        self.pos = prefix.length

    def decode_rows(self, rows: list[int], ids: list[int]) -> tuple[Tensor, Tensor]:
        logits, hidden = self.forward(ids)
        return logits[None], hidden

    def forward(self, ids: list[int], embeds: Tensor | None = None,
                embed_at: list[int] | None = None) -> tuple[Tensor, Tensor]:
        if embeds is not None:
            return self._forward_spliced(ids, embeds, embed_at)
        n = len(ids)
        if self.pos + n > self.max_len:
            raise UsageError(f"LLM context full: {self.pos + n} tokens > {self.max_len}")
        b = self.batch
        b.n_tokens = n
        for i, t in enumerate(ids):
            b.token[i] = t
            b.pos[i] = self.pos + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = True  # every token outputs: its embedding is the hidden state we need
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise BackendError(f"backend 'gguf': llama_decode failed (code {rc})")
        self.pos += n
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, n - 1), shape=(self.n_vocab,))
        hidden = np.stack([np.ctypeslib.as_array(self.lib.llama_get_embeddings_ith(self.ctx, i), shape=(self.n_embd,))
                           for i in range(n)])
        # on the pipeline's device, like every backend's (its sampler and the TTS take them there)
        return (torch.from_numpy(logits.copy()).to(self.device), torch.from_numpy(hidden.copy()).to(self.device))

    def _forward_spliced(self, ids: list[int], embeds: Tensor, embed_at: list[int]) -> tuple[Tensor, Tensor]:
        """ids with audio embeddings in some positions: llama.cpp's batches carry either token ids or
        input embeddings, so the runs of each go in turn (one decode call per run)."""
        if self.pos + len(ids) > self.max_len:
            raise UsageError(f"LLM context full: {self.pos + len(ids)} tokens > {self.max_len}")
        rows = dict(zip(embed_at, embeds.float().cpu().numpy()))
        hidden, start = [], 0
        while start < len(ids):
            spliced = start in rows
            end = start
            while end < len(ids) and (end in rows) == spliced:
                end += 1
            if spliced:
                logits, h = self._forward_embd(np.stack([rows[i] for i in range(start, end)]))
            else:
                logits, h = self.forward(ids[start:end])
            hidden.append(h)
            start = end
        return logits, torch.cat(hidden)

    def _forward_embd(self, rows: np.ndarray) -> tuple[Tensor, Tensor]:
        n = len(rows)
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        b = self.lib.llama_batch_init(n, self.n_embd, 1)
        try:
            b.n_tokens = n
            ctypes.memmove(b.embd, rows.ctypes.data, rows.nbytes)
            for i in range(n):
                b.pos[i] = self.pos + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = True
            rc = self.lib.llama_decode(self.ctx, b)
        finally:
            self.lib.llama_batch_free(b)
        if rc != 0:
            raise BackendError(f"backend 'gguf': llama_decode of input embeddings failed (code {rc})")
        self.pos += n
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, n - 1), shape=(self.n_vocab,))
        hidden = np.stack([np.ctypeslib.as_array(self.lib.llama_get_embeddings_ith(self.ctx, i), shape=(self.n_embd,))
                           for i in range(n)])
        return (torch.from_numpy(logits.copy()).to(self.device), torch.from_numpy(hidden.copy()).to(self.device))

    def __del__(self):
        batch = getattr(self, "batch", None)
        if batch is not None:
            self.lib.llama_batch_free(batch)


@dataclass(frozen=True, eq=False)
class Prefix:
    """A saved context: its length and llama.cpp's bytes of the sequence (see eager.Prefix)."""

    length: int
    state: bytes

    @property
    def nbytes(self) -> int:
        return len(self.state)


def create(ckpt, config: dict, *, device, dtype, max_len: int, gguf: str | None = None, rows: int = 1,
           invariant: bool = False) -> GGUFLLM:
    """`rows` is accepted and left at one: llama.cpp runs one stream here (see GGUFLLM.rows), so its
    LLM stage never shares a batch; `invariant` applies to the TTS head and codec (compile's)."""
    path = resolve_gguf(gguf)
    return GGUFLLM(path, max_len, torch.device(device))


# the TTS head, DVAE and Vocos run as in the compile backend (Triton steps, CUDA graphs)
tts_runner = compiled.tts_runner
wrap_codec = compiled.wrap_codec
