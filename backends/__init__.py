"""The registry of LLM-stage backends, chosen by name.

A backend runs the Qwen2 LLM stage of the speech path: it appends token ids to its context and returns
the next-token logits and the post-final-norm hidden states (the TTS takes its speaker vector from
them). Everything after the LLM (TTS head, DVAE, Vocos) is shared by all backends. Backends import
their heavy dependencies only when created; an unknown name or a missing optional dependency is an
error that says what to do, never a silent fallback to another backend (the one exception, loud and
per stage, is a kernel that cannot run on the user's GPU: kernels/fallback.py). `auto` is not a
backend but a choice made once, before loading (`choose`), from the device, the checkpoint and the
GPU's free memory.

What a backend is and what it costs are said by the backend itself: the first line of its module's
docstring (after "`name`: ") and its "Cost:" paragraph, read from the source without importing it
(the CLI's help and `minicpm backends` must not import torch). They say it in words that stay true
(a quarter of bf16's memory, faster than compile): measured figures, which go stale, belong in
docs/benchmarks.md (tests/test_cli.py checks).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from minicpm_cli.errors import BackendError, UnknownBackend

if TYPE_CHECKING:
    import torch

    from ..engine.checkpoint import Checkpoint


class LLMStage(Protocol):
    """What the pipeline needs from a backend."""

    name: str

    def reset(self) -> None:
        """Start an empty context."""

    def forward(self, ids: list[int], embeds: "torch.Tensor | None" = None,
                embed_at: list[int] | None = None) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Append ids -> (float32 logits of the last one (vocab,), hidden states (len(ids), dim)).
        `embeds` (k, dim), given with `embed_at` (k positions in ids), replace the input embeddings
        of those positions: a voice's audio embeddings in their placeholders (callers pass them only
        with a voice, so a stage without this still runs everything else).
        The tensors may be the backend's own buffers: valid until the next call (clone to keep)."""

    def save_prefix(self) -> Any:
        """A copy of the context so far (its KV cache), to start later contexts from."""

    def load_prefix(self, prefix: Any) -> None:
        """Start over from a saved context: the next forward continues it, as if it had just been
        computed."""


@dataclass(frozen=True)
class Backend:
    name: str
    module: str  # imported on first use: "minicpm_cli.backends.eager" defines create(...)
    requires: tuple[str, ...] = ()  # importable modules that must be present
    extra: str | None = None  # the pip extra that installs them
    default_model: str = "openbmb/MiniCPM-o-2_6"
    prefixes: tuple[str, ...] = ("llm.", "tts.")  # checkpoint tensors it needs (what is downloaded)
    triton: bool = False  # runs Triton kernels on a GPU (engine/warmstart.py computes Triton's key ahead)

    @property
    def summary(self) -> str:
        return _described(self.module)[0]

    @property
    def cost(self) -> str:
        return _described(self.module)[1]

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


    def tts_runner(self, model, rows: int = 1, invariant: bool = False):
        """The TTS runner this backend brings (compile: CUDA graphs), else the eager one; `rows`
        streams at once; `invariant`: batch-invariant kernels where the backend has them."""
        make = getattr(importlib.import_module(self.module), "tts_runner", None)
        if make is None:
            from ..engine.tts import TTSRunner

            return TTSRunner(model, rows=rows)
        return make(model, rows, invariant=invariant)


    def wrap_codec(self, codec, invariant: bool = False) -> None:
        """Let the backend speed up the codec too (compile: CUDA graphs); a no-op for others."""
        wrap = getattr(importlib.import_module(self.module), "wrap_codec", None)
        if wrap is not None:
            wrap(codec, invariant=invariant)


REGISTRY: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("eager", "minicpm_cli.backends.eager"),
        Backend("compile", "minicpm_cli.backends.compile", triton=True),
        Backend("int4", "minicpm_cli.backends.int4", default_model="openbmb/MiniCPM-o-2_6-int4", triton=True),
        Backend("gguf", "minicpm_cli.backends.gguf", requires=("llama_cpp",), extra="gguf", prefixes=("tts.",)),
    )
}
AUTO = "auto"


@functools.cache
def _described(module: str) -> tuple[str, str]:
    """(summary, cost) from a backend module's docstring, parsed without importing the module. Only the
    docstring is parsed (each backend module opens with one in triple double quotes): the CLI's help
    needs these at every start, and the four modules parsed whole took 20-25 ms of each `minicpm say`
    on the 2-core machine."""
    path = Path(__file__).with_name(module.rsplit(".", 1)[1] + ".py")
    text = path.read_text(encoding="utf-8")
    doc = ast.get_docstring(ast.parse(text[: text.find('"""', text.find('"""') + 3) + 3])) or ""
    paragraphs = [" ".join(p.split()) for p in doc.split("\n\n")]
    summary = re.sub(r"^`[\w-]+`:\s*", "", paragraphs[0])
    cost = next((p.removeprefix("Cost:").strip() for p in paragraphs if p.startswith("Cost:")), "")
    return summary, cost


def choose(model: str | None, device_type: str, *, gguf: str | None = None,
           triton: bool | None = None, free: int | None = None, dtype: str = "bfloat16") -> str:
    """The backend `auto` stands for: gguf when given a GGUF file; int4 for a GPTQ checkpoint (a local
    directory with quantize_config.json, or a hub repo named like the official one, `...-int4`);
    otherwise, on a CUDA GPU with Triton, compile where the bf16 model and a row of caches fit the
    `free` bytes (engine/memory.py's estimate in `dtype`; None: not known), else int4 (the official int4
    checkpoint, or a bf16 one quantized while loading), else a one-line error saying what fits;
    eager elsewhere."""
    if gguf is not None:
        return "gguf"
    if model is not None:
        path = Path(model).expanduser()
        if (path / "quantize_config.json").is_file() or (not path.exists() and model.rstrip("/").endswith("-int4")):
            return "int4"
    if device_type == "cuda":
        has_triton = importlib.util.find_spec("triton") is not None if triton is None else triton
        if has_triton:
            if free is None:
                return "compile"
            from ..engine import memory

            for name in ("compile", "int4"):
                if memory.need(name, dtype=dtype).rows(free) >= 1:
                    return name
            wide = memory.element_bytes(dtype) > 2
            raise BackendError(f"{free / memory.GB:.1f} GB of GPU memory are free: the {'float32' if wide else 'bf16'} "
                               f"model (compile) needs about {memory.need('compile', dtype=dtype).total(1) / memory.GB:.0f} "
                               f"GB and the int4 one about {memory.need('int4', dtype=dtype).total(1) / memory.GB:.0f} GB; "
                               f"free GPU memory{', or use --dtype bfloat16' if wide else ''}, or run the LLM "
                               "on llama.cpp (--backend gguf --gguf FILE) or on the CPU (--device cpu)")
    return "eager"


def get(name: str) -> Backend:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownBackend(f"unknown backend '{name}' (available: {AUTO}, {', '.join(REGISTRY)})") from None


def help_text() -> str:
    """What each choice of --backend is and costs, for the CLI's help."""
    parts = [f"{AUTO} (default): gguf when --gguf is given, int4 for a GPTQ checkpoint, else compile on a "
             "CUDA GPU where the bf16 model fits its free memory (int4 where only that fits), eager on a CPU "
             "(-v says which)."]
    parts += [f"{b.name}: {b.cost}" for b in REGISTRY.values()]
    return "\n\n".join(parts)
