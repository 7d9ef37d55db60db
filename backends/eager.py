"""`eager`: the Qwen2 LLM in plain PyTorch over a static KV cache, no compilation.

Cost: the slowest choice. About real time on an H200 (RTF 0.66 reading, 0.74 replying; first audio
0.35-0.56 s; host-bound), 15.2 GiB of GPU memory in bf16, no compilation. Runs on a CPU too (slowly).
"""

from __future__ import annotations

import torch
from torch import Tensor

from minicpm_cli.checkpoint import Checkpoint, load_module
from minicpm_cli.errors import UsageError
from minicpm_cli.models.qwen2 import Qwen2Config, Qwen2LM
from minicpm_cli.models.transformer import causal_mask


class EagerLLM:
    name = "eager"

    def __init__(self, model: Qwen2LM, max_len: int):
        self.model = model
        self.device = model.lm_head.weight.device
        self.max_len = max_len
        model.model.setup_cache(max_len, model.lm_head.weight.dtype, self.device)
        self.pos = 0
        self.version = f"torch {torch.__version__}"
        # bytes a decode step reads: every weight but the embedding table (one row of it)
        self.weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                                if not n.startswith("model.embed_tokens"))

    def reset(self) -> None:
        self.pos = 0  # stale cache slots past pos are masked until overwritten

    @torch.inference_mode()
    def forward(self, ids: list[int], embeds: Tensor | None = None,
                embed_at: list[int] | None = None) -> tuple[Tensor, Tensor]:
        end = self.pos + len(ids)
        if end > self.max_len:
            raise UsageError(f"LLM context full: {end} tokens > {self.max_len}")
        pos = torch.arange(self.pos, end, device=self.device)
        x = torch.tensor(ids, device=self.device)[None]
        audio = {} if embeds is None else {"embeds": embeds.to(self.device)[None],
                                           "embed_at": torch.tensor(embed_at, device=self.device)}
        logits, hidden = self.model(x, pos, causal_mask(pos, end), end, **audio)
        self.pos = end
        return logits[0, -1], hidden[0]


def build(ckpt: Checkpoint, config: dict, *, device, dtype) -> Qwen2LM:
    """The Qwen2 LLM from the checkpoint's `llm.*` tensors (the model every backend starts from)."""
    with torch.device("meta"):
        model = Qwen2LM(Qwen2Config.from_hf(config))
    load_module(model, ckpt, "llm.", dtype, device)
    return model.eval()


def create(ckpt: Checkpoint, config: dict, *, device, dtype, max_len: int, **options) -> EagerLLM:
    return EagerLLM(build(ckpt, config, device=device, dtype=dtype), max_len)
