"""Logit warpers and token choice, as tensors in and tensors out (no host synchronisation).

The warpers reproduce transformers' TopPLogitsWarper and TopKLogitsWarper (the reference applies
top-p first, then top-k). Sampling draws from the softmax with exponential noise (argmax of p/q with
q ~ Exp(1) is a draw from p) so that it never needs `torch.multinomial`'s host round trip; greedy
decoding is the argmax of the same probabilities. Any fixed assignment of independent draws to the
candidates gives a draw from p, so an LLM token's noise goes by the candidates' rank in its top-k
(`TokenNoise`: k values a token, drawn many tokens at a time), not by vocabulary id.
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


class TokenNoise:
    """A stream's Exp(1) draws for its LLM token choices (`llm.next_tokens`): k values a choice, one
    for each of its top-k candidates by rank, drawn from the stream's generator BLOCK choices at a
    time in one kernel. A choice then launches nothing of its own, and a batch of streams' choices
    stacks their rows in one copy (drawing a whole vocabulary a token, each stream had two launches
    a token: 256 for 128 streams). The draws depend only on the generator and on how many choices
    the stream has made, so a seeded stream chooses the same alone or in a batch."""

    BLOCK = 64

    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self.block: Tensor | None = None
        self.used = 0

    def next(self, k: int) -> Tensor:
        """The next choice's k draws (k,). A block whose width is not k is dropped (the top-k of a
        stream's choices changes only where the vocabulary is smaller than its top_k)."""
        if self.block is None or self.used == len(self.block) or self.block.shape[1] != k:
            self.block = noise((self.BLOCK, k), self.generator, self.generator.device)
            self.used = 0
        self.used += 1
        return self.block[self.used - 1]


def token_noise(generator: torch.Generator | None) -> TokenNoise | None:
    """A stream's `TokenNoise` from its sampling generator (on the device of its logits); None when
    greedy."""
    return None if generator is None else TokenNoise(generator)
