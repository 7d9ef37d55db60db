"""The registry of LLM-stage backends, chosen by name.

A backend runs the Qwen2 LLM stage of the speech path: it appends token ids to its context and returns
the next-token logits and the post-final-norm hidden states (the TTS takes its speaker vector from
them). Everything after the LLM (TTS head, DVAE, Vocos) is shared by all backends. Backends import
their heavy dependencies only when created; an unknown name or a missing optional dependency is an
error that says what to do, never a silent fallback to another backend.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from minicpm_cli.errors import BackendError

if TYPE_CHECKING:
    import torch

    from minicpm_cli.checkpoint import Checkpoint


class LLMStage(Protocol):
    """What the pipeline needs from a backend."""

    name: str

    def reset(self) -> None:
        """Start an empty context."""

    def forward(self, ids: list[int]) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Append ids -> (float32 logits of the last one (vocab,), hidden states (len(ids), dim)).
        The tensors may be the backend's own buffers: valid until the next call (clone to keep)."""


@dataclass(frozen=True)
class Backend:
    name: str
    summary: str
    module: str  # imported on first use: "backends.eager" defines create(...)
    requires: tuple[str, ...] = ()  # importable modules that must be present
    extra: str | None = None  # the pip extra that installs them
    default_model: str = "openbmb/MiniCPM-o-2_6"
    prefixes: tuple[str, ...] = ("llm.", "tts.")  # checkpoint tensors it needs (what is downloaded)

    def available(self) -> bool:
        return all(importlib.util.find_spec(m) is not None for m in self.requires)

    def check(self) -> None:
        missing = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if missing:
            how = f"pip install 'minicpm-cli[{self.extra}]'" if self.extra else "install " + ", ".join(missing)
            raise BackendError(f"backend '{self.name}' needs {', '.join(missing)}: {how}")

    def create(self, ckpt: "Checkpoint", config: dict, *, device: "torch.device", dtype: "torch.dtype",
               max_len: int, **options) -> LLMStage:
        """`options`: backend-specific settings (gguf: the GGUF file); None values are dropped."""
        self.check()
        options = {k: v for k, v in options.items() if v is not None}
        return importlib.import_module(self.module).create(ckpt, config, device=device, dtype=dtype,
                                                           max_len=max_len, **options)


    def tts_runner(self, model):
        """The TTS runner this backend brings (compile: CUDA graphs), else the eager one."""
        make = getattr(importlib.import_module(self.module), "tts_runner", None)
        if make is None:
            from minicpm_cli.tts import TTSRunner

            return TTSRunner(model)
        return make(model)


    def wrap_codec(self, codec) -> None:
        """Let the backend speed up the codec too (compile: CUDA graphs); a no-op for others."""
        wrap = getattr(importlib.import_module(self.module), "wrap_codec", None)
        if wrap is not None:
            wrap(codec)


REGISTRY: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("eager", "bf16/fp32 PyTorch, no compilation (the reference-faithful baseline)", "backends.eager"),
        Backend("compile", "static KV caches, fused projections, torch.compile and CUDA graphs (LLM and TTS)",
                "backends.compile"),
        Backend("int4", "the GPTQ int4 checkpoint on torch's int4 kernel, on the compile path",
                "backends.int4", default_model="openbmb/MiniCPM-o-2_6-int4"),
        Backend("gguf", "llama.cpp runs the LLM from a GGUF file (--gguf); TTS, DVAE and Vocos stay ours",
                "backends.gguf", requires=("llama_cpp",), extra="gguf", prefixes=("tts.",)),
    )
}


def get(name: str) -> Backend:
    try:
        return REGISTRY[name]
    except KeyError:
        raise BackendError(f"unknown backend '{name}' (available: {', '.join(REGISTRY)})") from None
