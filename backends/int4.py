"""`int4`: MiniCPM-o 2.6's LLM in 4 bits (the official GPTQ int4 checkpoint), on the compile path.

The Qwen2 model is built as usual, then the q/k/v/o and gate/up/down Linears of every decoder layer
are swapped for `Int4Linear` (backends/gptq.py), filled from the checkpoint's qweight/qzeros/
scales/g_idx; embeddings, norms and lm_head stay in the model dtype, as in the checkpoint. A checkpoint
without GPTQ tensors (a bf16 one, or random weights) is quantized while loading, round-to-nearest
with one group per output channel (the official checkpoint's layout). Steps then run as in the
`compile` backend (static caches, compiled layer halves, CUDA graphs), without projection fusion.
"""

from __future__ import annotations

import json

import torch

from minicpm_cli.checkpoint import Checkpoint, load_module
from minicpm_cli.errors import BackendError, CheckpointError
from minicpm_cli.models.qwen2 import Qwen2Config, Qwen2LM

from . import compile as compiled
from .gptq import Int4Linear, quantize

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


def build(ckpt: Checkpoint, config: dict, *, device, dtype) -> Qwen2LM:
    if torch.device(device).type == "cuda" and dtype != torch.bfloat16:
        raise BackendError("backend 'int4' on CUDA runs in bfloat16 (torch's int4 kernel): use --dtype bfloat16")
    has_gptq = bool(ckpt.keys("llm.model.layers.0.self_attn.q_proj.qweight"))
    if has_gptq:
        quantize_config(ckpt)
    with torch.device("meta"):
        model = Qwen2LM(Qwen2Config.from_hf(config))
    for i, layer in enumerate(model.model.layers):
        for name in QUANTIZED:
            key = f"llm.model.layers.{i}.{name}"
            parent_name, attr = name.split(".")
            parent = getattr(layer, parent_name)
            bias = ckpt.tensor(key + ".bias", dtype, device) if getattr(parent, attr).bias is not None else None
            if has_gptq:
                t = {k: ckpt.tensor(f"{key}.{k}", None, device) for k in ("qweight", "qzeros", "scales", "g_idx")}
            else:
                t = {k: v.to(device) for k, v in quantize(ckpt.tensor(key + ".weight", torch.float32, device), -1).items()}
            try:
                setattr(parent, attr, Int4Linear(**t, bias=bias, dtype=dtype, device=device))
            except (ValueError, RuntimeError) as e:
                raise CheckpointError(f"{key}: cannot use its GPTQ tensors: {e}") from None
    load_module(model, ckpt, "llm.", dtype, device)
    return model.eval()


def create(ckpt: Checkpoint, config: dict, *, device, dtype, max_len: int, **options) -> compiled.CompiledLLM:
    llm = compiled.CompiledLLM(build(ckpt, config, device=device, dtype=dtype), max_len, fuse=False)
    llm.name = "int4"
    return llm


tts_runner = compiled.tts_runner
wrap_codec = compiled.wrap_codec
