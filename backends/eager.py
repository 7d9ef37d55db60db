"""`eager`: the Qwen2 LLM in plain PyTorch over a static KV cache, no compilation.

Cost: the slowest choice on a GPU: a layer is many small kernel launches, so a step waits on the
host, not on the GPU. Nothing is compiled (no wait at a first command). The model's weights in bf16
on the GPU, 2 bytes a parameter, as compile. Runs on a CPU too (slowly). Batched generation
(`--batch`, a server's requests at once) is not batch-invariant on the GPU: in bfloat16 a request's
output in a batch may differ from its output alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..engine.checkpoint import Checkpoint, load_module
from minicpm_cli.errors import UsageError
from minicpm_cli.models.qwen2 import Qwen2Config, Qwen2LM
from minicpm_cli.models.transformer import causal_mask
from ..engine.tensorio import Upload, to_device


def decode_batch(model: Qwen2LM, ids: Tensor, pos: Tensor, kv: int, slots: Tensor,
                 block_fns: tuple | None = None) -> tuple[Tensor, Tensor]:
    """One token for each of the first nb cache rows: ids and positions (nb,) -> (float32 logits
    (nb, vocab), hidden (nb, dim)), each row attending causally over its own slots [0, kv)."""
    mask = (slots[None, :kv] <= pos[:, None])[:, None, None]  # (nb, 1, 1, kv)
    logits, hidden = model(ids[:, None], pos[:, None], mask, kv, block_fns=block_fns, rows=slice(0, len(ids)))
    return logits[:, -1], hidden[:, -1]


@dataclass(frozen=True, eq=False)
class Prefix:
    """A copy of the first `length` positions of one KV-cache row, every layer's K and V: a prompt's
    beginning computed once (a voice's turn) and put back into any row (`load_prefix_row`)."""

    length: int
    k: tuple[Tensor, ...]  # per layer (Hkv, length, D)
    v: tuple[Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


class Rows:
    """Where each KV-cache row of an LLM stage stands: the single-stream interface is row 0
    (`pos`, `reset`, `forward`); `forward_row` and `decode_rows` serve the others (batching).
    `save_prefix_row` / `load_prefix_row` copy a row's context out and back in (voice prefixes)."""

    rows = 1
    positions: list[int]
    prompt_in: Tensor | None = None  # batched prompts' inputs (prefill_rows), made at the first use
    prompt_fns: tuple | None = None  # a prompt's layer halves (Decoder.forward's block_fns), if not Block's

    @property
    def pos(self) -> int:
        return self.positions[0]

    @pos.setter
    def pos(self, value: int) -> None:
        self.positions[0] = value

    def reset(self) -> None:
        self.reset_row(0)

    def reset_row(self, row: int) -> None:
        self.positions[row] = 0  # stale cache slots past pos are masked until overwritten

    def forward(self, ids: list[int], embeds: Tensor | None = None,
                embed_at: list[int] | None = None) -> tuple[Tensor, Tensor]:
        return self.forward_row(0, ids, embeds, embed_at)

    def save_prefix(self) -> Prefix:
        return self.save_prefix_row(0)

    def load_prefix(self, prefix: Prefix) -> None:
        self.load_prefix_row(0, prefix)

    def _caches(self) -> list:
        return [layer.self_attn.kv_cache for layer in self.model.model.layers]

    @torch.inference_mode()
    def save_prefix_row(self, row: int) -> Prefix:
        """A copy of the row's context so far (positions 0..pos-1)."""
        n, caches = self.positions[row], self._caches()
        return Prefix(n, tuple(c.k[row, :, :n].clone() for c in caches), tuple(c.v[row, :, :n].clone() for c in caches))

    @torch.inference_mode()
    def load_prefix_row(self, row: int, prefix: Prefix) -> None:
        """Make the row's context `prefix` (what it held when saved, bit for bit); the next tokens go
        after it."""
        for c, k, v in zip(self._caches(), prefix.k, prefix.v):
            c.k[row, :, : prefix.length].copy_(k)
            c.v[row, :, : prefix.length].copy_(v)
        self.positions[row] = prefix.length

    def _check_room(self, row: int, n: int) -> int:
        end = self.positions[row] + n
        if end > self.max_len:
            raise UsageError(f"LLM context full: {end} tokens > {self.max_len}")
        return end

    @torch.inference_mode()
    def prefill_rows(self, rows: list[int], ids: list[list[int]]) -> list[tuple[Tensor, Tensor]]:
        """Several rows' prompts in one forward, padded to the longest, each at its own positions (the
        padding writes slots past a row's end, which its next tokens rewrite before anything reads
        them) -> per row (float32 logits of its last token (vocab,), hidden states (len, dim)); like
        forward_row's, static buffers where a backend replays graphs."""
        lens = [len(x) for x in ids]
        starts = [self.positions[r] for r in rows]
        for r, n in zip(rows, lens):
            self._check_room(r, n)
        n = len(rows)
        shape = self._prompt_shape(n, max(lens), max(starts))
        if shape is None:  # padding would run past a cache: one at a time (each copied out of the
            # static buffers, which the next row's forward of the same shape would overwrite)
            return [tuple(t.clone() for t in self.forward_row(r, x)) for r, x in zip(rows, ids)]
        nb, T, graph = shape
        if self.prompt_in is None:
            self.prompt_in = torch.zeros(self.rows, self.max_len + 3, dtype=torch.long, device=self.device)
            self.prompt_upload = Upload((self.rows, self.max_len + 3), self.device)
        # per entry: cache row, first position, index of the last token, ids (padded); entries past n
        # repeat the first, writing the same values to the same slots
        entries = [[r, s, k - 1] + x + [0] * (T - k) for r, s, k, x in zip(rows, starts, lens, ids)]
        self.prompt_upload(entries + entries[:1] * (nb - n), self.prompt_in[:nb, : T + 3])
        logits, hidden = self._run_prompts(nb, T, max(starts) + T, graph)
        for r, k in zip(rows, lens):
            self.positions[r] += k
        return [(logits[i], hidden[i, :k]) for i, k in enumerate(lens)]

    def _prompt_shape(self, n: int, longest: int, last_start: int) -> tuple[int, int, bool] | None:
        """(entries, padded length, run as a graph) of a batch of n prompts (backends round them up to
        their graphs' sizes); None when the padding would run past a cache."""
        return (n, longest, False) if last_start + longest <= self.max_len else None

    def _run_prompts(self, nb: int, T: int, kv: int, graph: bool) -> tuple[Tensor, Tensor]:
        return self._prompts(nb, T, kv)

    def _prompts(self, nb: int, T: int, kv: int) -> tuple[Tensor, Tensor]:
        """The `prompt_in` entries 0..nb-1 (T ids each), attending causally over slots [0, kv) ->
        (logits of each entry's last token (nb, vocab), hidden (nb, T, dim))."""
        inp = self.prompt_in[:nb, : T + 3]
        pos = inp[:, 1:2] + self.slots[:T]  # (nb, T)
        mask = (self.slots[None, None, :kv] <= pos[:, :, None])[:, None]  # (nb, 1, T, kv)
        _, hidden = self.model(inp[:, 3:], pos, mask, kv, logits_at=None, rows=inp[:, 0], block_fns=self.prompt_fns)
        last = hidden[torch.arange(nb, device=self.device), inp[:, 2]]  # (nb, dim)
        return self.model.lm_head(last).float(), hidden

    def _batch_inputs(self, rows: list[int], ids: list[int], nb: int) -> tuple[list[int], list[int], int]:
        """(ids, positions) of rows 0..nb-1 and the KV length to attend over. Rows without a token
        are computed too, at their own next slot (clamped into the cache), which their next real
        token rewrites before anything reads it."""
        for r in rows:
            self._check_room(r, 1)
        tok = [0] * nb
        for r, t in zip(rows, ids):
            tok[r] = t
        pos = [min(p, self.max_len - 1) for p in self.positions[:nb]]
        return tok, pos, max(pos[r] for r in rows) + 1


class EagerLLM(Rows):
    name = "eager"

    def __init__(self, model: Qwen2LM, max_len: int, rows: int = 1):
        self.model = model
        self.device = model.lm_head.weight.device
        self.max_len, self.rows = max_len, rows
        model.model.setup_cache(max_len, model.lm_head.weight.dtype, self.device, rows)
        self.positions = [0] * rows
        self.slots = torch.arange(max_len, device=self.device)  # (compile's CompiledLLM sets its own)
        self.version = f"torch {torch.__version__}"
        # bytes a decode step reads: every weight but the embedding table (one row of it)
        self.weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                                if not n.startswith("model.embed_tokens"))

    @torch.inference_mode()
    def forward_row(self, row: int, ids: list[int], embeds: Tensor | None = None,
                    embed_at: list[int] | None = None) -> tuple[Tensor, Tensor]:
        end = self._check_room(row, len(ids))
        pos = torch.arange(self.positions[row], end, device=self.device)
        x = torch.tensor(ids, device=self.device)[None]
        audio = {} if embeds is None else {"embeds": embeds.to(self.device)[None],
                                           "embed_at": torch.tensor(embed_at, device=self.device)}
        logits, hidden = self.model(x, pos, causal_mask(pos, end), end, rows=slice(row, row + 1), **audio)
        self.positions[row] = end
        return logits[0, -1], hidden[0]

    @torch.inference_mode()
    def decode_rows(self, rows: list[int], ids: list[int]) -> tuple[Tensor, Tensor]:
        """One token for each of `rows` (distinct) -> (logits (n, vocab), hidden (n, dim)) in that order."""
        nb = max(rows) + 1
        tok, pos, kv = self._batch_inputs(rows, ids, nb)
        inp = to_device([tok, pos], self.device)
        logits, hidden = decode_batch(self.model, inp[0], inp[1], kv, self.slots)
        for r in rows:
            self.positions[r] += 1
        at = to_device(rows, self.device)
        return logits.index_select(0, at), hidden.index_select(0, at)


def build(ckpt: Checkpoint, config: dict, *, device, dtype) -> Qwen2LM:
    """The Qwen2 LLM from the checkpoint's `llm.*` tensors (the model every backend starts from)."""
    with torch.device("meta"):
        model = Qwen2LM(Qwen2Config.from_hf(config))
    load_module(model, ckpt, "llm.", dtype, device)
    return model.eval()


def create(ckpt: Checkpoint, config: dict, *, device, dtype, max_len: int, rows: int = 1, **options) -> EagerLLM:
    return EagerLLM(build(ckpt, config, device=device, dtype=dtype), max_len, rows)
