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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.chattts import ChatTTS
from .sampling import choose, noise, top_k, top_p
from .tensorio import Upload, to_device

# Per-codebook temperatures hard-coded by every caller in the reference.
TEMPERATURES = (0.1, 0.3, 0.1, 0.3)
FRAMES_PER_CALL = 25  # the reference's output_chunk_size
MIN_FRAMES_PER_CALL = 10  # generate()'s min_new_token: EOS is blocked this long in every call
AUDIO_CHUNK = 50  # make_streaming_chunk_mask_generation's default streaming_audio_chunk_size
MIN_KEEP = 3
MAX_FRAMES = 2048  # the reference stops once a segment has more frames than this


class TTSRunner:
    """Eager generation for up to `rows` streams at once, each in its own row of the KV cache.

    The runner itself is row 0's view (`start`, `prefill`, `generate`, ...), the single-stream path;
    `lane(b)` is row b's. Per-step state lives in small device tensors with a leading row dimension
    (`*_b`; the single path's `*_t` names are row 0's views) that the step functions only read, so a
    backend can capture them as CUDA graphs (see backends/compile.py) and get the same results.
    `step_calls` advances several rows' `generate` calls by one step together (batching)."""

    invariant = False  # whether a row's arithmetic is the same in any batch (a backend's invariant mode)

    def __init__(self, model: ChatTTS, *, max_frames: int = MAX_FRAMES, block_fns: tuple | None = None,
                 rows: int = 1):
        c = model.config
        self.model, self.config, self.block_fns, self.rows = model, c, block_fns, rows
        self.batch_fns = block_fns  # the layer halves of batched steps
        dev = self.device = model.emb_text.weight.device
        self.dtype = model.emb_text.weight.dtype
        self.L = c.condition_length
        self.max_len = min(c.decoder.max_positions, self.L + max_frames + 2 * FRAMES_PER_CALL)
        model.model.setup_cache(self.max_len, self.dtype, dev, rows)
        self.slots = torch.arange(self.max_len, device=dev)
        self.temps = torch.tensor(TEMPERATURES, device=dev)[:, None]
        with torch.inference_mode():
            self.bos_embed = model.emb_text(torch.tensor([c.audio_bos_token_id], device=dev))  # (1, hidden)
        self.is_eos = self.slots[: c.num_audio_tokens] == c.eos_code
        # step inputs (written by the host loop between steps) and outputs (written by the step), per
        # row; the *_t names are row 0's, which the single-stream step reads
        self.last_b = torch.zeros(rows, c.num_vq, dtype=torch.long, device=dev)
        self.bos_b = torch.ones(rows, 1, dtype=torch.bool, device=dev)
        self.pos_b = torch.zeros(rows, dtype=torch.long, device=dev)
        self.block_b = torch.zeros(rows, 1, dtype=torch.bool, device=dev)
        self.noise_b = torch.ones(rows, c.num_vq, c.num_audio_tokens, device=dev)
        self.code_b = torch.zeros(rows, c.num_vq, dtype=torch.long, device=dev)
        self.last_t, self.bos_t, self.pos_t = self.last_b[0], self.bos_b[0], self.pos_b[:1]
        self.block_eos_t, self.noise_t, self.code_t = self.block_b[0], self.noise_b[0], self.code_b[0]
        # a batched step's control (position, EOS blocked, advances, step index in its call) per row,
        # uploaded without waiting (the host prepares a step while the one before runs); the codes of
        # each row's call so far (step FRAMES_PER_CALL is where idle rows write)
        self.ctl = torch.zeros(4, rows, dtype=torch.long, device=dev)
        self.ctl_upload = Upload((4, rows), dev)
        # batched text prefills' inputs (prefill_rows)
        self.prefill_in = torch.zeros(rows, self.L + 4, dtype=torch.long, device=dev)
        self.prefill_upload = Upload((rows, self.L + 4), dev)
        self.spk_b = torch.zeros(rows, c.decoder.dim, dtype=self.dtype, device=dev)
        # each row's call's noise by step (step FRAMES_PER_CALL: what idle rows read), written once a call
        self.noise_calls = torch.ones(rows, FRAMES_PER_CALL + 1, c.num_vq, c.num_audio_tokens, device=dev)
        self.calls_out = torch.zeros(rows, FRAMES_PER_CALL + 1, c.num_vq, dtype=torch.long, device=dev)
        self.row_ids = torch.arange(rows, device=dev)
        # Position from which each cache slot is visible (spec §4.1): a text slot s once
        # V(p) >= s - 1, an audio slot once written (p >= s), [Ptts] and [PAD]s never. A query's
        # mask is then one comparison, `visible_from <= p`.
        r, chunk = c.streaming_text_reserved_len, c.streaming_text_chunk_size
        s_ = self.slots[: self.L]
        self._text_from = torch.where(s_ < 2, 0, r + 1 + AUDIO_CHUNK * (torch.div(s_ - 1 + chunk - 1, chunk,
                                                                               rounding_mode="floor") - 1))
        self.vis_b = self.slots.repeat(rows, 1)  # (rows, max_len)
        self.visible_from = self.vis_b[0]
        self.never = self.max_len + AUDIO_CHUNK * r  # beyond any position
        self.trace: list[tuple[Tensor, Tensor]] | None = None  # (raw logits, probs) per step, for tests
        self.positions = [self.L - 1] * rows  # each row's next query position (host)
        self.lanes = [TTSLane(self, b) for b in range(rows)]
        self.reset_rows(list(range(rows)))
        self.set_text_len_rows(list(range(rows)), [0] * rows)

    # --- row 0, the single-stream interface (a lane) ---

    @property
    def pos(self) -> int:
        return self.positions[0]

    @pos.setter
    def pos(self, value: int) -> None:
        self.positions[0] = value

    def lane(self, row: int) -> "TTSLane":
        """The streaming interface of one row, whose generate() calls can be batched with others'."""
        return self.lanes[row]

    def start(self, n: int) -> None:
        """A new segment with n text tokens: zero cache, next query at the [Ptts] slot."""
        self.start_row(0, n)

    @torch.inference_mode()
    def speakers(self, hidden: Tensor) -> Tensor:
        """The LLM's hidden states at <|spk|> (n, llm_dim), from any device -> unit speaker vectors
        (n, hidden), each what it gets alone (`speaker`): in one batch where the backend's products
        and norms are row-invariant (`invariant`), else one row at a time (the CPU's and cuBLAS's
        products round a row otherwise in a batch)."""
        h = hidden.to(self.device, self.dtype)
        if self.invariant or len(h) == 1:
            return self.model.speaker(h)
        return torch.cat([self.model.speaker(h[i : i + 1]) for i in range(len(h))])

    def speaker(self, hidden: Tensor) -> Tensor:
        """One stream's speaker vector (hidden,) from its hidden state at <|spk|> (llm_dim,)."""
        return self.speakers(hidden[None])[0]

    def set_text_len(self, n: int) -> None:
        self.set_text_len_row(0, n)

    @torch.inference_mode()
    def prefill(self, ids: list[int], begin: int, spk: Tensor | None = None) -> None:
        """Write the K/V of condition slots begin..begin+len(ids)-1 (plain causal attention)."""
        self.prefill_row(0, ids, begin, spk)

    def prefill_audio(self, frames: Tensor) -> None:
        self.prefill_audio_row(0, frames)

    def visible_text(self, p: int) -> int:
        """V(p): how many text slots (after [Stts][spk_emb]) a query at position p may see."""
        r = self.config.streaming_text_reserved_len
        return min(self.config.streaming_text_chunk_size * -(-(p - r) // AUDIO_CHUNK), r)

    # --- any row ---

    def start_row(self, row: int, n: int) -> None:
        self.reset_rows([row])
        self.set_text_len_row(row, n)

    def reset_rows(self, rows: list[int]) -> None:
        """A new segment in each of `rows`: cache zeroed, next query at the [Ptts] slot with [bos] as
        its input; each run of consecutive rows in one op a tensor (a batch's streams that start in
        one round hold rows 0..n-1: a few launches for all of them, not a few each)."""
        for a, b in _runs(sorted(rows)):
            self.model.model.reset_cache(slice(a, b))
            self.bos_b[a:b].fill_(True)
        for r in rows:
            self.positions[r] = self.L - 1

    def set_text_len_row(self, row: int, n: int) -> None:
        """_build_streaming_mask(n): [Stts], [spk_emb], n text tokens and [Etts] visible; [PAD]s not."""
        self.vis_b[row, : self.L].copy_(self._text_visible_from(n))

    def set_text_len_rows(self, rows: list[int], ns: list[int]) -> None:
        """`set_text_len_row` for each row and its n, in one upload and a few launches for all."""
        if len(rows) == 1:
            self.set_text_len_row(rows[0], ns[0])
            return
        at = to_device([rows, ns], self.device)
        self.vis_b[at[0], : self.L] = self._text_visible_from(at[1][:, None])

    def _text_visible_from(self, n: int | Tensor) -> Tensor:
        """The text slots' `vis_b` for n text tokens ((L,); n a (k, 1) tensor: (k, L))."""
        s = self.slots[: self.L]
        visible = (s <= n + 2) & (s < self.L - 1)  # the reference's mask also marks [Ptts], but no query sees it
        return torch.where(visible, self._text_from, self.never)

    def _prefill(self, ids: Tensor, begin: Tensor, kv_len: int, spk: Tensor | None, rows=None) -> None:
        """ids at positions begin.. (`begin` a 1-element device tensor, so a graph can replay this
        for any start), attending causally over cache slots [0, kv_len) of cache row `rows`."""
        x = self.model.embed_text(ids, spk)
        pos = begin + self.slots[: len(ids)]
        mask = self.slots[None, :kv_len] <= pos[:, None]
        self.model.model(x, pos, mask[None, None], kv_len, rows=rows)

    @torch.inference_mode()
    def prefill_row(self, row: int, ids: list[int], begin: int, spk: Tensor | None = None) -> None:
        self._prefill(torch.tensor(ids, device=self.device), self.slots[begin : begin + 1], begin + len(ids), spk,
                      slice(row, row + 1))

    @torch.inference_mode()
    def prefill_rows(self, rows: list[int], ids: list[list[int]], begins: list[int],
                     spks: list[Tensor | None]) -> None:
        """Several rows' `prefill_row`s in one forward, padded to the longest, each at its own slots
        and with its own speaker vector where given: each row's cache ends as `prefill_row` leaves it
        (the K/V its padding wrote past its chunk are zeroed again: a text slot the mask already
        shows may be written only by a later chunk, and until then it must hold what it holds alone).
        Padding that would reach the [Ptts] slot, or beyond, runs them one at a time."""
        T = self.prefill_len(max(len(x) for x in ids), max(begins))
        if T is None:
            for r, x, b, spk in zip(rows, ids, begins, spks):
                self.prefill_row(r, x, b, spk)
            return
        n = len(rows)
        nb = self.bucket(n)
        # per entry: cache row, first slot, speaker vector given, length, ids (padded); entries past
        # n repeat the first, writing the same values to the same slots
        entries = [[r, b, spk is not None, len(x)] + x + [0] * (T - len(x))
                   for r, b, x, spk in zip(rows, begins, ids, spks)]
        self.prefill_upload(entries + entries[:1] * (nb - n), self.prefill_in[:nb, : T + 4])
        for i, spk in enumerate(spks + spks[:1] * (nb - n)):
            if spk is not None:
                self.spk_b[i].copy_(spk)
        self._run_prefills(nb, T, max(begins) + T)

    def prefill_len(self, longest: int, last_begin: int) -> int | None:
        """The padded length of a batch of text prefills (backends round it up to their graph sizes);
        None when the padding would reach the [Ptts] slot."""
        return longest if last_begin + longest <= self.L - 1 else None

    def _run_prefills(self, nb: int, T: int, kv: int) -> None:
        self._prefill_batch(nb, T, kv)

    def _prefill_batch(self, nb: int, T: int, kv: int) -> None:
        """The `prefill_in` entries 0..nb-1 (T ids each) through the backbone, attending causally over
        cache slots [0, kv)."""
        inp = self.prefill_in[:nb, : T + 4]
        tok = inp[:, 4:]
        x = self.model.emb_text(tok)  # (nb, T, hidden)
        is_spk = (tok == self.config.spk_emb_token_id) & (inp[:, 2:3] > 0)
        x = torch.where(is_spk[..., None], self.spk_b[:nb, None].to(x.dtype), x)
        pos = inp[:, 1:2] + self.slots[:T]  # (nb, T)
        mask = (self.slots[None, None, :kv] <= pos[:, :, None])[:, None]  # (nb, 1, T, kv)
        rows = inp[:, 0]
        self.model.model(x, pos, mask, kv, rows=rows)
        pad = (self.slots[:T] >= inp[:, 3:4])[..., None, None]  # (nb, T, 1, 1): the padding's slots
        for layer in self.model.model.layers:
            c = layer.self_attn.kv_cache
            for cache in (c.k, c.v):
                cache[rows[:, None], :, pos] = cache[rows[:, None], :, pos].masked_fill(pad, 0)

    def _visibility(self, pos: Tensor, kv_len: int, audio_upto: Tensor | None = None, row: int = 0) -> Tensor:
        """(1, 1, 1, kv_len) mask for a query of `row` at position `pos` (a 1-element device tensor):
        text slots 2..V(pos)+1 minus [PAD]s, [Stts]/[spk_emb], audio slots up to `audio_upto`
        (default pos). Tensor ops only: no host synchronisation, capturable in a CUDA graph."""
        seen = self.vis_b[row, :kv_len] <= pos
        if audio_upto is not None:
            slots = self.slots[:kv_len]
            seen = seen | ((slots >= self.L) & (slots <= audio_upto))
        return seen[None, None, None]

    @torch.inference_mode()
    def prefill_audio_row(self, row: int, frames: Tensor) -> None:
        """Seed a continuation segment with frames carried over (spec §4.5 step 7): [Ptts] and all but
        the last frame go through one forward whose single mask row (that of the [Ptts] query, with
        the current text mask) is shared by every query, so they see each other in both directions.
        The last frame becomes the input of the next generation step."""
        x = torch.cat([self.bos_embed, self.model.embed_codes(frames[:-1])])[None]  # (1, k, hidden)
        start, end = self.L - 1, self.L - 1 + len(frames)
        pos = self.slots[start:end]
        self.model.model(x, pos, self._visibility(pos[:1], end, pos[-1:], row), end, rows=slice(row, row + 1))
        self.positions[row] = end
        self.last_b[row].copy_(frames[-1])
        self.bos_b[row].fill_(False)

    # --- one stream's step (row 0) ---

    def _step(self, kv_len: int, sampled: bool) -> tuple[Tensor, Tensor]:
        """One audio frame from the step tensors -> code_t; returns (raw logits, probs)."""
        raw = self._logits(self._decode(self._step_input(), kv_len))  # (num_vq, num_audio_tokens)
        return raw, self._choose(raw, sampled)

    def _step_input(self) -> Tensor:
        """Row 0's input embedding (hidden,) from bos_t and last_t (`_embed`)."""
        return self._embed(self.bos_b[:1], self.last_b[:1])[0]

    def _logits(self, h: Tensor) -> Tensor:
        """Final hidden state (hidden,) -> raw float32 logits (num_vq, num_audio_tokens)."""
        return self.model.logits(h)

    def _choose(self, raw: Tensor, sampled: bool) -> Tensor:
        """Raw logits -> probabilities after temperature, top-p, top-k and the EOS block; the chosen
        codes go to code_t."""
        probs = self._probs(raw, self.bos_t, self.block_eos_t)
        self.code_t.copy_(choose(probs, self.noise_t if sampled else None))
        return probs

    def _probs(self, raw: Tensor, bos: Tensor, block_eos: Tensor) -> Tensor:
        """raw (..., num_vq, V) with bos/block_eos (..., 1) -> probabilities to choose from."""
        c = self.config
        logits = raw / self.temps
        # the BOS step samples from the plain distribution; later steps after top-p then top-k
        bos, block_eos = bos[..., None], block_eos[..., None]  # (..., 1, 1)
        logits = torch.where(bos, logits, top_k(top_p(logits, c.top_p, MIN_KEEP), c.top_k, MIN_KEEP))
        logits = logits.masked_fill(self.is_eos & block_eos, float("-inf"))
        return F.softmax(logits, dim=-1)

    def _decode(self, x: Tensor, kv_len: int) -> Tensor:
        """The backbone on one input embedding (hidden,) at pos_t -> final hidden state (hidden,)."""
        h = self.model.model(x[None, None], self.pos_t, self._visibility(self.pos_t, kv_len), kv_len, self.block_fns)
        return h[0, -1]

    def run_step(self, sampled: bool) -> tuple[Tensor, Tensor]:
        """Row 0's step at `pos` (`_step` over the cache so far) -> (raw logits, probs); a backend
        may run it otherwise (a CUDA graph, the Triton kernels)."""
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
            raw, probs = self.run_step(q is not None)
            if self.trace is not None:
                self.trace.append((raw.clone(), probs.clone()))
            out[i].copy_(self.code_t)
            self.last_t.copy_(self.code_t)
            self.bos_t.fill_(False)
            self.pos += 1
        return self._finish(out[:steps], n_steps)

    def _finish(self, out: Tensor, n_steps: int, eos: Tensor | None = None) -> tuple[Tensor, bool]:
        """A call's frames `out` (k, num_vq) -> (those before its first EOS, finished). `eos`: each
        frame's EOS flag (k,) on the host, where already fetched (else one host round trip here).
        Frames after the first EOS were computed but are dropped; nothing reads the cache past an EOS."""
        if eos is None:
            eos = (out == self.config.eos_code).any(1)
        hits = eos.nonzero()
        if len(hits):
            return out[: int(hits[0])], True
        return out, len(out) < n_steps

    # --- several streams' steps at once ---

    def call(self, row: int, generator: torch.Generator | None, n_steps: int = FRAMES_PER_CALL,
             min_new: int = MIN_FRAMES_PER_CALL, allow_eos: bool = True) -> "Call":
        """Row `row`'s next generate() call, to be advanced by `step_calls` (its noise is drawn now,
        from the stream's own generator, exactly as `generate` draws it)."""
        if generator is None:
            self.noise_calls[row].fill_(1.0)  # argmax(p / 1) is the greedy choice
        else:  # (drawn in place: the values `noise` gives a fresh tensor of this shape, one launch)
            self.noise_calls[row, :n_steps].exponential_(1, generator=generator)
        return Call(row, min(n_steps, self.max_len - self.positions[row]), n_steps,
                    n_steps if not allow_eos else min_new, generator is not None)

    def step_calls(self, calls: list["Call"]) -> list["Call"]:
        """Advance each call (one per row) by one step in one batched forward over rows 0..nb-1
        (rows without a call in between are computed but left as they were: their step rewrites, at
        their own next position, what their next real step writes first) -> the calls now done, with
        `result` set."""
        nb = self.bucket(max(c.row for c in calls) + 1)
        ctl = [[self.positions[b] for b in range(nb)], [0] * nb, [0] * nb, [FRAMES_PER_CALL] * nb]
        for c in calls:
            ctl[1][c.row], ctl[2][c.row], ctl[3][c.row] = int(c.done < c.min_new), 1, c.done
        ctl[0] = [min(p, self.max_len - 1) for p in ctl[0]]  # (a finished row's position may be the end)
        kv = max(ctl[0][c.row] for c in calls) + 1
        self.ctl_upload(ctl, self.ctl[:, :nb])
        self.run_batch(nb, kv, any(c.sampled for c in calls))
        done = []
        for c in calls:
            c.done += 1
            self.positions[c.row] += 1
            if c.done == c.steps:
                done.append(c)
        if done:  # one wait for the device for every call that ends here
            eos = (self.calls_out[:nb] == self.config.eos_code).any(2).cpu()
            for c in done:
                c.result = self._finish(self.calls_out[c.row, : c.steps].clone(), c.n_steps, eos[c.row, : c.steps])
        return done

    def bucket(self, n: int) -> int:
        """Rows a batched step runs over for rows 0..n-1 (backends round up to their graph sizes)."""
        return n

    def run_batch(self, nb: int, kv: int, sampled: bool) -> None:
        """One batched step over rows 0..nb-1 with `kv` cache slots (`batch_step`), then `advance`;
        a backend may run the step otherwise (a CUDA graph, the batched kernels)."""
        self.batch_step(nb, kv, sampled)
        self.advance(nb)

    def batch_step(self, nb: int, kv: int, sampled: bool) -> None:
        """One frame for rows 0..nb-1 from `ctl` and the row state -> code_b (greedy rows choose with
        noise 1). It changes no input, so a backend can run it more than once (graph warm-up)."""
        m = self.model
        last, pos, bos, block = self._row_state(nb)
        x = self._embed(bos, last)
        mask = (self.vis_b[:nb, :kv] <= pos[:, None])[:, None, None]  # (nb, 1, 1, kv)
        h = m.model(x[:, None], pos[:, None], mask, kv, self.batch_fns, rows=slice(0, nb))[:, -1]  # (nb, hidden)
        probs = self._probs(m.logits(h), bos, block)
        self.code_b[:nb].copy_(choose(probs, self.noise_b[:nb]) if sampled else choose(probs, None))

    def _row_state(self, nb: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """A batched step's inputs from `ctl` and the row state -> (last codes (nb, num_vq), positions
        (nb,), BOS (nb, 1), EOS blocked (nb, 1)); positions and EOS blocks also to pos_b, block_b."""
        pos, block = self.ctl[0, :nb], self.ctl[1, :nb, None] > 0
        self.noise_b[:nb].copy_(self.noise_calls[self.row_ids[:nb], self.ctl[3, :nb]])
        self.pos_b[:nb].copy_(pos)
        self.block_b[:nb].copy_(block)
        return self.last_b[:nb], pos, self.bos_b[:nb], self.block_b[:nb]

    def _embed(self, bos: Tensor, last: Tensor) -> Tensor:
        """Step rows' input embeddings (nb, hidden): BOS (nb, 1) rows the audio BOS embedding, the
        others the sum of their last codes' (nb, num_vq) embeddings."""
        return torch.where(bos, self.bos_embed, self.model.embed_codes(last))

    def advance(self, nb: int) -> None:
        """After a batched step: the codes into each row's call output (idle rows' to the spare step),
        and the rows that took part move on to them."""
        codes, adv = self.code_b[:nb], self.ctl[2, :nb, None] > 0
        self.calls_out[self.row_ids[:nb], self.ctl[3, :nb]] = codes
        bos, last = self.bos_b[:nb], self.last_b[:nb]
        last.copy_(torch.where(adv, codes, last))
        bos.copy_(bos & ~adv)


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted rows as runs of consecutive rows [a, b)."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


@dataclass
class Call:
    """One stream's generate() call in progress (see TTSRunner.call / step_calls)."""

    row: int
    steps: int  # steps it runs (n_steps, or fewer at the end of the cache)
    n_steps: int  # steps asked for
    min_new: int  # EOS blocked in steps 0..min_new-1
    sampled: bool  # its Exp(1) draws are in the runner's noise_calls row (else greedy)
    done: int = 0
    result: tuple[Tensor, bool] | None = None


class TTSLane:
    """Row `row` of a TTSRunner, with the interface the streaming state machine uses. Its `generate`
    runs through `step_calls`: alone here, or batched with other rows by whoever set `batcher`
    (a function taking the Call and returning when it is done)."""

    def __init__(self, runner: TTSRunner, row: int):
        self.runner, self.row = runner, row
        self.config, self.L, self.device, self.dtype = runner.config, runner.L, runner.device, runner.dtype
        self.batcher = None
        self.prefiller = None  # (row, ids, begin, spk) -> None: a batch's text prefills, run together
        self.starter = None  # (row, n, reset) -> None: a batch's starts and text lengths, set together
        self.projector = None  # (row, hidden) -> speaker vector: a batch's, projected together

    @property
    def pos(self) -> int:
        return self.runner.positions[self.row]

    def start(self, n: int) -> None:
        if self.starter is not None:
            self.starter(self.row, n, True)
        else:
            self.runner.start_row(self.row, n)

    def set_text_len(self, n: int) -> None:
        if self.starter is not None:
            self.starter(self.row, n, False)
        else:
            self.runner.set_text_len_row(self.row, n)

    def prefill(self, ids: list[int], begin: int, spk: Tensor | None = None) -> None:
        if self.prefiller is not None:
            self.prefiller(self.row, ids, begin, spk)
        else:
            self.runner.prefill_row(self.row, ids, begin, spk)

    def prefill_audio(self, frames: Tensor) -> None:
        self.runner.prefill_audio_row(self.row, frames)

    def speaker(self, hidden: Tensor) -> Tensor:
        """The speaker vector (hidden,) of the LLM's hidden state at <|spk|> (llm_dim,)."""
        if self.projector is not None:
            return self.projector(self.row, hidden)
        return self.runner.speaker(hidden)

    def visible_text(self, p: int) -> int:
        return self.runner.visible_text(p)

    @torch.inference_mode()
    def generate(self, generator: torch.Generator | None, n_steps: int = FRAMES_PER_CALL,
                 min_new: int = MIN_FRAMES_PER_CALL, allow_eos: bool = True) -> tuple[Tensor, bool]:
        call = self.runner.call(self.row, generator, n_steps, min_new, allow_eos)
        if call.steps <= 0:
            return self.runner._finish(self.runner.calls_out[self.row, :0], n_steps)
        if self.batcher is not None:
            self.batcher(call)
        else:
            while call.result is None:
                self.runner.step_calls([call])
        return call.result
