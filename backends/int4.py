"""`int4`: the official GPTQ int4 checkpoint, its 4-bit weights read by our Triton/CUDA kernels on the compile path.

The Qwen2 model is built as usual, then the q/k/v/o and gate/up/down Linears of every decoder layer
are swapped for 4-bit ones (backends/gptq.py), filled from the checkpoint's qweight/qzeros/scales/
g_idx; embeddings, norms and lm_head stay in the model dtype, as in the checkpoint. On CUDA they are
`Q4Linear`s: q/k/v and gate/up are stacked, one-token steps run the compile backend's fused Triton
decode kernels reading the 4-bit weights directly, and prefills of up to 512 tokens a Triton
tensor-core product that unpacks the words in registers (longer ones dequantize slices of the
weights into a scratch buffer for cuBLAS). On a CPU they are `Int4Linear`s on torch's int4 kernel. A
checkpoint without GPTQ tensors (a bf16 one) is quantized while loading, round-to-nearest with one
group per output channel (the official checkpoint's layout); random weights are drawn as 4-bit
values directly.

Cost: 4-bit weights: the LLM's decoder layers take about a quarter of bf16's memory (embeddings and
lm_head stay bf16), and a decode token reads a quarter of their bytes, so the LLM decodes faster
than compile's; the rest (TTS head, codec, first-command compilation) is compile's. Batch-invariant
by default on a GPU, as compile (its 4-bit products on `q4_invariant`); `--batch-variant` keeps the
faster 4-bit GEMVs for one token. Output close to,
not equal to, the bf16 model's. A bf16 checkpoint is quantized while loading (slower to start than
the official int4 checkpoint).
"""

from __future__ import annotations

import json

import torch

from minicpm_cli import trace
from ..engine.checkpoint import Checkpoint, load_module
from minicpm_cli.errors import BackendError, CheckpointError
from minicpm_cli.models.qwen2 import Qwen2Config, Qwen2LM
from ..engine.synthetic import RandomCheckpoint, generator

from . import compile as compiled
from .gptq import Int4Linear, Q4Linear, quantize

QUANTIZED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def quantize_config(ckpt: Checkpoint) -> dict | None:
    path = ckpt.root / "quantize_config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if cfg.get("bits") != 4 or cfg.get("checkpoint_format", "gptq") != "gptq":
        raise CheckpointError(f"{path}: only 4-bit GPTQ checkpoints ('gptq' format) are supported")
    return cfg


def random_gptq(shape: tuple[int, int], device, g: torch.Generator) -> dict:
    """Random 4-bit weights in the official layout (per channel, symmetric) for an nn.Linear weight
    shape (out, in), drawn directly from `g` (on `device`): random words, scales of a 0.02-std
    weight, zero point 8."""
    out, n_in = shape
    words = torch.randint(-(2**31), 2**31, (n_in // 8, out), dtype=torch.int32, device=device, generator=g)
    scales = torch.full((1, out), 0.02 / 4.6, dtype=torch.float16, device=device)  # (q - 8) has std ~4.6
    zeros = torch.full((1, out // 8), 0x77777777, dtype=torch.int32, device=device)
    return {"qweight": words, "qzeros": zeros, "scales": scales, "g_idx": torch.zeros(n_in, dtype=torch.int32, device=device)}


def build(ckpt: Checkpoint, config: dict, *, device, dtype, triton: bool | None = None) -> Qwen2LM:
    """The Qwen2 LLM with 4-bit projections: `Q4Linear` (Triton kernels; the default on CUDA) or
    `Int4Linear` (torch's int4 kernel; the default on a CPU)."""
    triton = torch.device(device).type == "cuda" if triton is None else triton
    if torch.device(device).type == "cuda" and not triton and dtype != torch.bfloat16:
        raise BackendError("backend 'int4' with torch's int4 kernel on CUDA runs in bfloat16: use --dtype bfloat16")
    has_gptq = bool(ckpt.keys("llm.model.layers.0.self_attn.q_proj.qweight"))
    if has_gptq:
        quantize_config(ckpt)
    drawn = isinstance(ckpt, RandomCheckpoint)
    with torch.device("meta"):
        model = Qwen2LM(Qwen2Config.from_hf(config))
    layers = range(len(model.model.layers))
    biases = [f"llm.model.layers.{i}.{n}.bias" for i in layers for n in QUANTIZED
              if getattr(getattr(model.model.layers[i], n.split(".")[0]), n.split(".")[1]).bias is not None]
    if has_gptq:  # 4-bit tensors are small: all in one pass
        ckpt.prefetch([f"llm.model.layers.{i}.{n}.{k}" for i in layers for n in QUANTIZED
                       for k in ("qweight", "qzeros", "scales", "g_idx")] + biases, device)
    for i, layer in enumerate(model.model.layers):
        if not has_gptq and not drawn:  # full-precision weights to quantize: a layer at a time
            ckpt.prefetch([f"llm.model.layers.{i}.{n}.weight" for n in QUANTIZED], device)
        for name in QUANTIZED:
            key = f"llm.model.layers.{i}.{name}"
            parent_name, attr = name.split(".")
            parent = getattr(layer, parent_name)
            bias = ckpt.tensor(key + ".bias", dtype, device) if getattr(parent, attr).bias is not None else None
            if has_gptq:
                t = {k: ckpt.tensor(f"{key}.{k}", None, device) for k in ("qweight", "qzeros", "scales", "g_idx")}
            elif drawn:  # random weights: drawn as 4-bit values (no float copy, no quantizing)
                t = random_gptq(ckpt.shape(key + ".weight"), device, generator(key + ".qweight", ckpt.seed, device))
            else:
                t = {k: v.to(device) for k, v in quantize(ckpt.tensor(key + ".weight", torch.float32, device), -1).items()}
            try:
                with trace.span("prepare"):
                    setattr(parent, attr, (Q4Linear if triton else Int4Linear)(**t, bias=bias, dtype=dtype, device=device))
            except (ValueError, RuntimeError) as e:
                raise CheckpointError(f"{key}: cannot use its GPTQ tensors: {e}") from None
            del t
    load_module(model, ckpt, "llm.", dtype, device)
    return model.eval()


def create(ckpt: Checkpoint, config: dict, *, device, dtype, max_len: int, rows: int = 1, invariant: bool = False,
           **options) -> compiled.CompiledLLM:
    model = build(ckpt, config, device=device, dtype=dtype)
    first = model.model.layers[0].self_attn.q_proj
    # Q4Linears stack into fused q/k/v and gate/up for the Triton decode kernels unless act-order
    # permutes their inputs differently; Int4Linears (CPU) run unfused on the compiled layer halves
    fuse = isinstance(first, Q4Linear) and all(
        m.perm is None for m in model.modules() if isinstance(m, Q4Linear))
    llm = compiled.CompiledLLM(model, max_len, fuse=fuse, rows=rows, invariant=invariant)
    llm.name = "int4"
    # batched tokens: the layers as written (their 4-bit products on our kernels) in CUDA graphs;
    # torch.compile would trace into the kernels' launchers (which it does not take in one graph)
    llm.compile_batches = False
    return llm


tts_runner = compiled.tts_runner
wrap_codec = compiled.wrap_codec
