"""Logit warpers and token choice, as tensors in and tensors out (no host synchronisation).

The warpers reproduce transformers' TopPLogitsWarper and TopKLogitsWarper (the reference applies
top-p first, then top-k). Sampling draws from the softmax with exponential noise (argmax of p/q with
q ~ Exp(1) is a draw from p) so that it never needs `torch.multinomial`'s host round trip; greedy
decoding is the argmax of the same probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    """How tokens and audio codes are chosen. `greedy` takes the argmax everywhere."""

    greedy: bool = False
    seed: int | None = None

    def generator(self, device) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def top_p(logits: Tensor, p: float, min_keep: int = 1) -> Tensor:
    """Keep the smallest set of tokens whose probability mass exceeds p (at least min_keep)."""
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= (1 - p)
    remove[..., -min_keep:] = False
    return logits.masked_fill(remove.scatter(-1, sorted_idx, remove), float("-inf"))


def top_k(logits: Tensor, k: int, min_keep: int = 1) -> Tensor:
    k = min(max(k, min_keep), logits.size(-1))
    kth = torch.topk(logits, k)[0][..., -1, None]
    return logits.masked_fill(logits < kth, float("-inf"))


def noise(shape: tuple[int, ...], generator: torch.Generator | None, device) -> Tensor | None:
    """Exp(1) noise for `choose`, drawn ahead (one kernel for many steps); None when greedy."""
    if generator is None:
        return None
    return torch.empty(shape, device=device).exponential_(1, generator=generator)


def choose(probs: Tensor, q: Tensor | None) -> Tensor:
    """probs (..., V) -> indices (...,): argmax when q is None, else a draw per row: argmax(p / q)."""
    if q is None:
        return probs.argmax(dim=-1)
    return (probs / q).argmax(dim=-1)
