"""The TTS step's choice of codes in one launch (`sample_codes`): temperature, top-p and top-k as
transformers' warpers keep them, the EOS block, softmax, and the greedy or drawn code of each
codebook (see minicpm_cli.engine.sampling.choose).

Tests: tests/test_kernels.py (`test_code_sampling_kernel_matches_torch`, and the TTS runner on the
kernels against the eager one).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _sample_codes(raw_ptr, temp_ptr, bos_ptr, block_eos_ptr, noise_ptr, probs_ptr, code_ptr, top_p,
                  V: tl.constexpr, TOP_K: tl.constexpr, MIN_KEEP: tl.constexpr, SAMPLED: tl.constexpr,
                  BLOCK_V: tl.constexpr):
    """Program (q, b): codebook q of step row b (one row: b = 0): logits / temperature, then (except
    on the row's BOS step) top-p and top-k as transformers' warpers keep them, EOS (the last code)
    blocked when the row asks, softmax, and the argmax of probs (greedy) or of probs / noise (a draw,
    see minicpm_cli.engine.sampling.choose). A row's codes are what it gets alone."""
    b = tl.program_id(1)
    row = b * tl.num_programs(0) + tl.program_id(0)
    bos_ptr += b
    block_eos_ptr += b
    i = tl.arange(0, BLOCK_V)
    inside = i < V
    t = tl.load(temp_ptr + tl.program_id(0))
    x = tl.math.div_rn(tl.load(raw_ptr + row * V + i, mask=inside, other=float("-inf")), t)
    # top-p: the token of descending rank r stays if the probability mass of ranks < r is below p
    # (i.e. its ascending cumulative mass exceeds 1 - p), the first MIN_KEEP always; top-k keeps
    # the K largest of those. Both keep a prefix of the ranking, so the K largest are walked one at
    # a time (no full sort) and the last kept value becomes the threshold (ties at it stay).
    top = tl.max(x, 0)
    mass = tl.sum(tl.exp(x - top), 0)
    rest = x
    above = 0.0
    cut = top
    for r in tl.static_range(TOP_K):
        at = tl.argmax(rest, 0)
        v = tl.max(rest, 0)
        cut = tl.where((r < MIN_KEEP) | (above < top_p * mass), v, cut)
        above += tl.exp(v - top)
        rest = tl.where(i == at, float("-inf"), rest)
    warped = tl.where(x >= cut, x, float("-inf"))
    x = tl.where(tl.load(bos_ptr) != 0, x, warped)
    x = tl.where((i == V - 1) & (tl.load(block_eos_ptr) != 0), float("-inf"), x)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    tl.store(probs_ptr + row * V + i, p, mask=inside)
    if SAMPLED:
        score = p / tl.load(noise_ptr + row * V + i, mask=inside, other=1.0)
    else:
        score = p
    tl.store(code_ptr + row, tl.argmax(tl.where(inside, score, -1.0), 0))


def sample_codes(raw: Tensor, temps: Tensor, bos: Tensor, block_eos: Tensor, noise: Tensor | None,
                 probs: Tensor, codes: Tensor, top_p: float, top_k: int, min_keep: int) -> None:
    """`_sample_codes` over raw (num_vq, V) float32 logits -> probs (num_vq, V), codes (num_vq,); or
    over rows: raw, noise, probs (rows, num_vq, V), bos, block_eos (rows, 1), codes (rows, num_vq)."""
    q, v = raw.shape[-2:]
    rows = raw.numel() // (q * v)
    _sample_codes[(q, rows)](raw, temps, bos, block_eos, noise if noise is not None else raw, probs, codes, top_p,
                             V=v, TOP_K=max(top_k, min_keep), MIN_KEEP=min_keep, SAMPLED=noise is not None,
                             BLOCK_V=triton.next_power_of_2(v), num_warps=2)
