"""The TTS runner: condition slots, the chunk-visibility mask and audio-code generation.

Layout (spec §3.3): slots 0..301 hold [Stts], [spk_emb], 300 text/[Etts]/[PAD] slots; slot 302 is
the [Ptts] audio-BOS input, whose own K/V no query ever sees; audio frame k is the input at position
303+k. The KV cache is preallocated, zero-filled, and written at input positions.

A query at position p sees text slots 2..V(p)+1 with V(p) = min(10*ceil((p-300)/50), 300), minus
[PAD] slots, plus [Stts]/[spk_emb] and every audio slot up to itself (spec §4.1). Each `generate`
call is one reference `generate()` call: EOS is blocked for its first `min_new` steps, top-p/top-k
apply except on the BOS step, and it ends at the first frame where any codebook emits EOS.
This module knows ids and tensors; tokenization and audio decoding live elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .models.chattts import ChatTTS
from .sampling import choose, noise, top_k, top_p

# Per-codebook temperatures hard-coded by every caller in the reference.
TEMPERATURES = (0.1, 0.3, 0.1, 0.3)
FRAMES_PER_CALL = 25  # the reference's output_chunk_size
MIN_FRAMES_PER_CALL = 10  # generate()'s min_new_token: EOS is blocked this long in every call
AUDIO_CHUNK = 50  # make_streaming_chunk_mask_generation's default streaming_audio_chunk_size
MIN_KEEP = 3
MAX_FRAMES = 2048  # the reference stops once a segment has more frames than this


class TTSRunner:
    """Eager generation. Per-step state lives in small device tensors that `_step` only reads, so a
    backend can capture `_step` as a CUDA graph (see backends/compile.py) and get the same results."""

    def __init__(self, model: ChatTTS, *, max_frames: int = MAX_FRAMES, block_fns: tuple | None = None):
        c = model.config
        self.model, self.config, self.block_fns = model, c, block_fns
        dev = self.device = model.emb_text.weight.device
        self.dtype = model.emb_text.weight.dtype
        self.L = c.condition_length
        self.max_len = min(c.decoder.max_positions, self.L + max_frames + 2 * FRAMES_PER_CALL)
        model.model.setup_cache(self.max_len, self.dtype, dev)
        self.slots = torch.arange(self.max_len, device=dev)
        self.temps = torch.tensor(TEMPERATURES, device=dev)[:, None]
        with torch.inference_mode():
            self.bos_embed = model.emb_text(torch.tensor([c.audio_bos_token_id], device=dev))  # (1, hidden)
        self.is_eos = self.slots[: c.num_audio_tokens] == c.eos_code
        # step inputs (written by the host loop between steps) and outputs (written by _step)
        self.last_t = torch.zeros(c.num_vq, dtype=torch.long, device=dev)
        self.bos_t = torch.ones(1, dtype=torch.bool, device=dev)
        self.pos_t = torch.zeros(1, dtype=torch.long, device=dev)
        self.block_eos_t = torch.zeros(1, dtype=torch.bool, device=dev)
        self.noise_t = torch.ones(c.num_vq, c.num_audio_tokens, device=dev)
        self.code_t = torch.zeros(c.num_vq, dtype=torch.long, device=dev)
        # Position from which each cache slot is visible (spec §4.1): a text slot s once
        # V(p) >= s - 1, an audio slot once written (p >= s), [Ptts] and [PAD]s never. A query's
        # mask is then one comparison, `visible_from <= p`.
        r, chunk = c.streaming_text_reserved_len, c.streaming_text_chunk_size
        s_ = self.slots[: self.L]
        self._text_from = torch.where(s_ < 2, 0, r + 1 + AUDIO_CHUNK * (torch.div(s_ - 1 + chunk - 1, chunk,
                                                                               rounding_mode="floor") - 1))
        self.visible_from = self.slots.clone()
        self.never = self.max_len + AUDIO_CHUNK * r  # beyond any position
        self.trace: list[tuple[Tensor, Tensor]] | None = None  # (raw logits, probs) per step, for tests
        self.start(0)

    def start(self, n: int) -> None:
        """A new segment with n text tokens: zero cache, next query at the [Ptts] slot."""
        self.model.model.reset_cache()
        self.pos = self.L - 1
        self.bos_t.fill_(True)
        self.set_text_len(n)

    def set_text_len(self, n: int) -> None:
        """_build_streaming_mask(n): [Stts], [spk_emb], n text tokens and [Etts] visible; [PAD]s not."""
        s = self.slots[: self.L]
        visible = (s <= n + 2) & (s < self.L - 1)  # the reference's mask also marks [Ptts], but no query sees it
        self.visible_from[: self.L].copy_(torch.where(visible, self._text_from, self.never))

    def _prefill(self, ids: Tensor, begin: Tensor, kv_len: int, spk: Tensor | None) -> None:
        """ids at positions begin.. (`begin` a 1-element device tensor, so a graph can replay this
        for any start), attending causally over cache slots [0, kv_len)."""
        x = self.model.embed_text(ids, spk)
        pos = begin + self.slots[: len(ids)]
        mask = self.slots[None, :kv_len] <= pos[:, None]
        self.model.model(x, pos, mask[None, None], kv_len)

    @torch.inference_mode()
    def prefill(self, ids: list[int], begin: int, spk: Tensor | None = None) -> None:
        """Write the K/V of condition slots begin..begin+len(ids)-1 (plain causal attention)."""
        self._prefill(torch.tensor(ids, device=self.device), self.slots[begin : begin + 1], begin + len(ids), spk)

    def visible_text(self, p: int) -> int:
        """V(p): how many text slots (after [Stts][spk_emb]) a query at position p may see."""
        r = self.config.streaming_text_reserved_len
        return min(self.config.streaming_text_chunk_size * -(-(p - r) // AUDIO_CHUNK), r)

    def _visibility(self, pos: Tensor, kv_len: int, audio_upto: Tensor | None = None) -> Tensor:
        """(1, 1, 1, kv_len) mask for a query at position `pos` (a 1-element device tensor): text
        slots 2..V(pos)+1 minus [PAD]s, [Stts]/[spk_emb], audio slots up to `audio_upto` (default pos).
        Tensor ops only: no host synchronisation, capturable in a CUDA graph."""
        seen = self.visible_from[:kv_len] <= pos
        if audio_upto is not None:
            slots = self.slots[:kv_len]
            seen = seen | ((slots >= self.L) & (slots <= audio_upto))
        return seen[None, None, None]

    @torch.inference_mode()
    def prefill_audio(self, frames: Tensor) -> None:
        """Seed a continuation segment with frames carried over (spec §4.5 step 7): [Ptts] and all but
        the last frame go through one forward whose single mask row (that of the [Ptts] query, with
        the current text mask) is shared by every query, so they see each other in both directions.
        The last frame becomes the input of the next generation step."""
        x = torch.cat([self.bos_embed, self.model.embed_codes(frames[:-1])])[None]  # (1, k, hidden)
        start, end = self.L - 1, self.L - 1 + len(frames)
        pos = self.slots[start:end]
        self.model.model(x, pos, self._visibility(pos[:1], end, pos[-1:]), end)
        self.pos = end
        self.last_t.copy_(frames[-1])
        self.bos_t.fill_(False)

    def _step(self, kv_len: int, sampled: bool) -> tuple[Tensor, Tensor]:
        """One audio frame from the step tensors -> code_t; returns (raw logits, probs)."""
        m = self.model
        x = torch.where(self.bos_t, self.bos_embed[0], m.embed_codes(self.last_t))  # (hidden,)
        raw = m.logits(self._decode(x, kv_len))  # (num_vq, num_audio_tokens)
        return raw, self._choose(raw, sampled)

    def _choose(self, raw: Tensor, sampled: bool) -> Tensor:
        """Raw logits -> probabilities after temperature, top-p, top-k and the EOS block; the chosen
        codes go to code_t."""
        c = self.config
        logits = raw / self.temps
        # the BOS step samples from the plain distribution; later steps after top-p then top-k
        logits = torch.where(self.bos_t, logits, top_k(top_p(logits, c.top_p, MIN_KEEP), c.top_k, MIN_KEEP))
        logits = logits.masked_fill(self.is_eos & self.block_eos_t, float("-inf"))
        probs = F.softmax(logits, dim=-1)
        self.code_t.copy_(choose(probs, self.noise_t if sampled else None))
        return probs

    def _decode(self, x: Tensor, kv_len: int) -> Tensor:
        """The backbone on one input embedding (hidden,) at pos_t -> final hidden state (hidden,)."""
        h = self.model.model(x[None, None], self.pos_t, self._visibility(self.pos_t, kv_len), kv_len, self.block_fns)
        return h[0, -1]

    def _run_step(self, sampled: bool) -> tuple[Tensor, Tensor]:
        return self._step(self.pos + 1, sampled)

    @torch.inference_mode()
    def generate(self, generator: torch.Generator | None, n_steps: int = FRAMES_PER_CALL,
                 min_new: int = MIN_FRAMES_PER_CALL, allow_eos: bool = True) -> tuple[Tensor, bool]:
        """Up to n_steps frames -> (codes (k, num_vq) without the EOS row, finished).
        `allow_eos=False` blocks EOS in every step (for runs of a forced length)."""
        if not allow_eos:
            min_new = n_steps
        c = self.config
        out = torch.empty(n_steps, c.num_vq, dtype=torch.long, device=self.device)
        steps = min(n_steps, self.max_len - self.pos)
        q = noise((n_steps, c.num_vq, c.num_audio_tokens), generator, self.device)
        for i in range(steps):
            self.pos_t.fill_(self.pos)
            self.block_eos_t.fill_(i < min_new)
            if q is not None:
                self.noise_t.copy_(q[i])
            raw, probs = self._run_step(q is not None)
            if self.trace is not None:
                self.trace.append((raw.clone(), probs.clone()))
            out[i].copy_(self.code_t)
            self.last_t.copy_(self.code_t)
            self.bos_t.fill_(False)
            self.pos += 1
        # One host round trip per call: frames after the first EOS were computed but are dropped;
        # nothing reads the cache past an EOS.
        hits = (out[:steps] == c.eos_code).any(1).nonzero()
        if len(hits):
            return out[: int(hits[0])], True
        return out[:steps], steps < n_steps
