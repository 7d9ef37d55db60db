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
from .sampling import choose, top_k, top_p

# Per-codebook temperatures hard-coded by every caller in the reference.
TEMPERATURES = (0.1, 0.3, 0.1, 0.3)
FRAMES_PER_CALL = 25  # the reference's output_chunk_size
MIN_FRAMES_PER_CALL = 10  # generate()'s min_new_token: EOS is blocked this long in every call
AUDIO_CHUNK = 50  # make_streaming_chunk_mask_generation's default streaming_audio_chunk_size
MIN_KEEP = 3
MAX_FRAMES = 2048  # the reference stops once a segment has more frames than this


class TTSRunner:
    def __init__(self, model: ChatTTS, *, max_frames: int = MAX_FRAMES):
        c = model.config
        self.model, self.config = model, c
        self.device = model.emb_text.weight.device
        self.dtype = model.emb_text.weight.dtype
        self.L = c.condition_length
        self.max_len = min(c.decoder.max_positions, self.L + max_frames + 2 * FRAMES_PER_CALL)
        model.model.setup_cache(self.max_len, self.dtype, self.device)
        self.slots = torch.arange(self.max_len, device=self.device)
        self.temps = torch.tensor(TEMPERATURES, device=self.device)[:, None]
        self.bos_embed = model.emb_text(torch.tensor([c.audio_bos_token_id], device=self.device))
        self.trace: list[tuple[Tensor, Tensor]] | None = None  # (raw logits, probs) per step, for tests
        self.start(0)

    def start(self, n: int) -> None:
        """A new segment with n text tokens: zero cache, next query at the [Ptts] slot."""
        self.model.model.reset_cache()
        self.pos = self.L - 1
        self.last: Tensor | None = None
        self.set_text_len(n)

    def set_text_len(self, n: int) -> None:
        """_build_streaming_mask(n): [Stts], [spk_emb], n text tokens and [Etts] visible; [PAD]s not."""
        self.text_mask = self.slots[: self.L] <= n + 2
        self.text_mask[self.L - 1] = True

    @torch.inference_mode()
    def prefill(self, ids: list[int], begin: int, spk: Tensor | None = None) -> None:
        """Write the K/V of condition slots begin..begin+len(ids)-1 (plain causal attention)."""
        end = begin + len(ids)
        x = self.model.embed_text(torch.tensor(ids, device=self.device), spk)
        pos = self.slots[begin:end]
        mask = self.slots[None, :end] <= pos[:, None]
        self.model.model(x, pos, mask[None, None], end)

    def visible_text(self, p: int) -> int:
        """V(p): how many text slots (after [Stts][spk_emb]) a query at position p may see."""
        r = self.config.streaming_text_reserved_len
        return min(self.config.streaming_text_chunk_size * -(-(p - r) // AUDIO_CHUNK), r)

    def _mask(self, p: int, kv_len: int | None = None) -> Tensor:
        """(1, 1, 1, kv_len) visibility for a query at position p (kv_len defaults to p + 1)."""
        kv_len = kv_len or p + 1
        text = self.text_mask & (self.slots[: self.L] < self.visible_text(p) + 2)
        audio = self.slots[self.L : kv_len] >= 0
        return torch.cat([text, audio])[None, None, None]

    @torch.inference_mode()
    def prefill_audio(self, frames: Tensor) -> None:
        """Seed a continuation segment with frames carried over (spec §4.5 step 7): [Ptts] and all but
        the last frame go through one forward whose single mask row (that of the [Ptts] query, with
        the current text mask) is shared by every query, so they see each other in both directions.
        The last frame becomes the input of the next generation step."""
        x = torch.cat([self.bos_embed, self.model.embed_codes(frames[:-1])])[None]  # (1, k, hidden)
        start, end = self.L - 1, self.L - 1 + len(frames)
        self.model.model(x, self.slots[start:end], self._mask(start, end), end)
        self.pos = end
        self.last = frames[-1]

    @torch.inference_mode()
    def generate(self, generator: torch.Generator | None, n_steps: int = FRAMES_PER_CALL,
                 min_new: int = MIN_FRAMES_PER_CALL, allow_eos: bool = True) -> tuple[Tensor, bool]:
        """Up to n_steps frames -> (codes (k, num_vq) without the EOS row, finished).
        `allow_eos=False` blocks EOS in every step (for runs of a forced length)."""
        if not allow_eos:
            min_new = n_steps
        c = self.config
        eos = c.eos_code
        out = torch.empty(n_steps, c.num_vq, dtype=torch.long, device=self.device)
        steps = min(n_steps, self.max_len - self.pos)
        for i in range(steps):
            bos = self.last is None
            x = self.bos_embed if bos else self.model.embed_codes(self.last)[None]
            p = self.pos
            h = self.model.model(x[None], self.slots[p : p + 1], self._mask(p), p + 1)
            raw = self.model.logits(h[0, -1])  # (num_vq, num_audio_tokens)
            logits = raw / self.temps
            if not bos:
                logits = top_k(top_p(logits, c.top_p, MIN_KEEP), c.top_k, MIN_KEEP)
            if i < min_new:
                logits[:, eos] = float("-inf")
            probs = F.softmax(logits, dim=-1)
            if self.trace is not None:
                self.trace.append((raw, probs))
            out[i] = self.last = choose(probs, generator)
            self.pos += 1
        # One host round trip per call: frames after the first EOS were computed but are dropped;
        # nothing reads the cache past an EOS.
        hits = (out[:steps] == eos).any(1).nonzero()
        if len(hits):
            return out[: int(hits[0])], True
        return out[:steps], steps < n_steps
