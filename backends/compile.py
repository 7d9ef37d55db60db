"""`compile`: fused projections; Triton decode kernels and CUDA graphs for the LLM and TTS steps (prefills torch.compile'd).

The model is transformed, not forked: q/k/v and gate/up projections are concatenated
(`Decoder.fuse`). On CUDA a one-token step (an LLM decode token, a TTS audio frame) runs the layers
on Triton kernels (backends/kernels/decode.py: five launches per layer, the position read on the
device, so one CUDA graph serves every position). Prefills, and one-token steps on a CPU or with projections
that do not fuse (int4 with act-order groups), run the layer halves around attention
(`Block.pre_attention/post_attention`) compiled with torch.compile, as CUDA graphs captured per
shape with attention over a bucketed KV length. Inputs reach a graph through small device tensors
written between replays (an LLM decode token's id and position through pinned host memory, copied
in by the graph itself); nothing synchronises with the host except the one end-of-call check of
the TTS runner and, before a decode token, the wait for the previous one's graph. On a CPU the same
code runs without graphs.

Cost: the model's weights in bf16 on the GPU, as eager (the fused copies replace the originals).
Much faster than eager on a CUDA GPU, where a one-token step is one CUDA graph replay that the host
does not hold back. The first command on a machine compiles the Triton kernels (seconds; cached on
disk for later commands), and each process captures its CUDA graphs as it warms up. Batch-invariant
by default on a GPU (backends/invariant.py): a request's audio is the same alone and in any batch,
at some cost to one reply's LLM tokens (the tensor-core product where `--batch-variant` runs GEMVs).

Over the house's ~450 lines as one backend: the LLM's and the TTS's compiled steps, their graphs and
warm-ups, which share their buckets and static buffers (the kernels themselves live in kernels/).
"""

from __future__ import annotations

import contextlib
import importlib
from collections import OrderedDict

import torch
from torch import Tensor

from minicpm_cli import trace
from ..engine.checkpoint import Checkpoint
from ..engine.codec import StreamDecoder
from minicpm_cli.errors import BackendError
from minicpm_cli.models.chattts import ChatTTS
from minicpm_cli.models.transformer import Block
from ..engine.tensorio import Upload, to_device
from ..engine.sampling import choose
from ..engine.tts import FRAMES_PER_CALL, MIN_KEEP, TTSRunner

from .eager import Rows, build, decode_batch

LLM_BUCKET = 256  # KV length granularity of the LLM graphs
TTS_BUCKET = 128
# prefill lengths of the graphs: powers of two, and halfway steps from 256 on (a 10-s voice turn is
# ~300 tokens: 384 instead of 512 saves a quarter of its prefill)
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
GRAPH_PROMPT_TOKENS = 1024  # a batch of prompts up to this many tokens replays a graph (CompiledLLM)
PROMPT_WARM_LENGTHS = PREFILL_BUCKETS[:4]  # batched prompts captured at warm-up: 16-128 tokens (reads, replies)
# `gemv` launch shapes of the LLM's lm_head (0.24 ms on an H200; cuBLAS: 0.34) and of the TTS's code
# heads (one K-block); they fit every architecture of kernels/targets.py (tests/test_targets.py)
LM_HEAD_GEMV = {"rows": 4, "block_k": 512, "warps": 4}
HEADS_GEMV = {"rows": 4, "block_k": 1024, "warps": 4}
_compiled: dict[bool, tuple] = {}


def block_fns(dynamic: bool = False) -> tuple:
    """torch.compile'd Block halves for one-token steps (shared by every layer of both models);
    `dynamic`: one compilation for every batch size (the batched steps on CUDA, which otherwise
    launch some twenty small kernels a layer)."""
    if dynamic not in _compiled:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        try:
            _compiled[dynamic] = (torch.compile(Block.pre_attention, fullgraph=True, dynamic=dynamic),
                                  torch.compile(Block.post_attention, fullgraph=True, dynamic=dynamic))
        except Exception as e:  # no silent fallback: say which backend failed
            raise BackendError(f"backend 'compile': torch.compile failed: {e}") from None
    return _compiled[dynamic]


def _invariant():
    """backends/invariant.py, imported where the batch-invariant kernels are used (it needs Triton,
    which a CPU-only torch may lack)."""
    return importlib.import_module(f"{__package__}.invariant")


def _kernels(module: str):
    """A module of backends/kernels (`decode`, `matvec`, ...), which need Triton (part of PyTorch's
    CUDA builds on Linux)."""
    try:
        return importlib.import_module(f"{__package__}.kernels.{module}")
    except ImportError as e:
        raise BackendError(f"backend 'compile' on CUDA needs Triton ({e}): pip install triton") from None


def _fallbacks() -> int:
    """How many stages have fallen back to their eager path (kernels/fallback.py); 0 without Triton."""
    try:
        return _kernels("fallback").events()
    except BackendError:
        return 0


def _fallback(stage: str):
    """A `Fallback` for `stage` (kernels/fallback.py): its kernels, or its eager path once one fails."""
    return _kernels("fallback").Fallback(stage)


class Graphs:
    """Replays `fn()` (reading and writing static tensors only) as one CUDA graph per key, captured
    on first use after two warm-up runs; on a CPU it simply calls fn."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.graphs: dict = {}
        self.pool = None

    def run(self, key, fn):
        if not self.cuda:
            return fn()
        entry = self.graphs.get(key)
        if entry is None:
            fallbacks = _fallbacks()
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with trace.span("graph_warmup", key=str(key)), torch.cuda.stream(stream):  # (first runs: JIT)
                    for _ in range(2):
                        fn()
                    stream.synchronize()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with trace.span("graph_capture"), torch.cuda.graph(graph, pool=self.pool):
                    out = fn()
            except Exception as e:
                if _fallbacks() != fallbacks:  # a kernel failed in it: its stage is eager now, capture that
                    return self.run(key, fn)
                if type(e).__name__ == "OutOfMemoryError":  # (the CLI's boundary names the fix)
                    raise
                raise BackendError(f"backend 'compile': capturing a CUDA graph failed: {e}") from None
            self.pool = graph.pool()
            entry = self.graphs[key] = (graph, out)
        entry[0].replay()
        return entry[1]

    def drop(self, key) -> None:
        """Forget `key`'s graph: its output and working memory go back to the pool for later captures."""
        self.graphs.pop(key, None)


def _bucket(n: int, step: int, cap: int) -> int:
    return min(-(-n // step) * step, cap)


def _padded(n: int, start: int, end: int) -> int:
    """The length a prefill of n tokens from `start` runs at: the next PREFILL_BUCKETS length (one
    graph serves many lengths), or n where that padding would run past `end`."""
    t = next((b for b in PREFILL_BUCKETS if b >= n), n)
    return t if start + t <= end else n


def batch_bucket(n: int, rows: int) -> int:
    """Rows a batched step runs over for rows 0..n-1: a power of two (one CUDA graph each), at most `rows`."""
    return min(1 << (n - 1).bit_length(), rows)


def batch_sizes(rows: int, cap: int) -> list[int]:
    """The batch buckets (`batch_bucket`, at most `cap` rows) that batches of 2..`rows` rows reach:
    2, 4, 8, ..., and `cap` itself where it is not a power of two."""
    return sorted({batch_bucket(n, cap) for n in range(2, rows + 1)})


class CompiledLLM(Rows):
    name = "compile"

    def __init__(self, model, max_len: int, fuse: bool = True, use_triton: bool | None = None, rows: int = 1,
                 invariant: bool = False):
        self.model = model
        dev = self.device = model.lm_head.weight.device
        self.max_len, self.rows = max_len, rows
        kernels = use_triton if use_triton is not None else dev.type == "cuda"  # (tests: interpreter)
        # batch-invariant (invariant.py): every token on the invariant layer, none on the GEMV kernels
        self.invariant = bool(invariant and kernels)
        if fuse:
            with trace.span("prepare"):
                model.model.fuse()
        model.model.setup_cache(max_len, model.lm_head.weight.dtype, dev, rows)
        model.model.setup_rope(model.config.decoder.max_positions, dev)
        if self.invariant:
            _invariant().make_invariant(model)
            _invariant().invariant_tokens(model.model)
        self.positions = [0] * rows
        self.slots = torch.arange(max_len, device=dev)
        self.ids = torch.zeros(max_len, dtype=torch.long, device=dev)
        self.upload = Upload((max_len,), dev)  # prompt ids into `ids`
        self.pos0 = torch.zeros(1, dtype=torch.long, device=dev)
        self.last = torch.zeros(1, dtype=torch.long, device=dev)
        self.row = torch.zeros(1, dtype=torch.long, device=dev)  # the cache row of a prefill of row > 0
        self.batch_in = torch.zeros(2, rows, dtype=torch.long, device=dev)  # a batched step's ids, positions
        # a decode token's (id, position): written on the host, copied in by the decode graph's first
        # node (pinned memory: the copy reads it when the graph runs), so a token launches one graph
        cuda = dev.type == "cuda"
        self.host = torch.zeros(2, dtype=torch.long, pin_memory=cuda)
        self.host_np = self.host.numpy()
        self.batch_upload = Upload((2, rows), dev)  # a batch's ids and positions into `batch_in`
        self.inp = torch.zeros(2, dtype=torch.long, device=dev)
        self.read = torch.cuda.Event() if cuda else None  # the last decode graph has run
        self.graphs = Graphs(dev)
        self.audio: Tensor | None = None  # a voice turn's input embeddings, by position (_stage_audio)
        self.is_audio: Tensor | None = None
        # decode tokens on the Triton kernels where the projections are fused bf16/fp32 Linears
        self.triton = None
        if fuse and kernels and not self.invariant:
            self.triton = _kernels("decode").TritonDecode(model.model)
            self.lm_head = _kernels("common").Weight(model.lm_head.weight)
            self.logits = torch.zeros(model.lm_head.out_features, device=dev)
            self.hidden = torch.zeros(1, model.config.decoder.dim, dtype=model.lm_head.weight.dtype, device=dev)
            self.lm_head_cfg = dict(LM_HEAD_GEMV)  # (its own: tests and sweeps change a runner's)
            self.fallback = _fallback("the LLM's decode step")
        # torch.compile'd layer halves only where one-token steps do not run on the Triton kernels
        # (a CPU, act-order int4): creating them imports torch._dynamo, seconds of a start
        self.fns = block_fns() if self.triton is None and not self.invariant else None
        self.batch_fns = self.fns if self.triton is None else None  # (block_fns(True) once a batch runs)
        self.compile_batches = not self.invariant  # int4: its Triton products are not traced by torch.compile
        # invariant: a batched token's layer in nine launches (the eager layer's bits), where it fits
        inv = _invariant() if self.invariant else None
        self.tokens = inv.FusedTokens(model) if inv and inv.FusedTokens.fits(model) else None
        self.prompt_fns = inv.FusedPrompt.fns() if self.tokens is not None else None  # (fewer launches)
        if self.invariant:
            self.version = (f"torch {torch.__version__}, triton {_kernels('common').triton.__version__} "
                            "(batch-invariant products + CUDA graphs)")
        elif self.triton is not None:
            self.version = (f"torch {torch.__version__}, triton {_kernels('common').triton.__version__} "
                            "(Triton decode + CUDA graphs)")
        else:
            self.version = f"torch {torch.__version__} (inductor + CUDA graphs)"
        # bytes a decode step reads: the weights (quantized ones included), but not the embedding
        # table (one row of it), the KV cache or index buffers
        tensors = [*model.named_parameters(), *model.named_buffers()]
        self.weight_bytes = sum(t.numel() * t.element_size() for n, t in tensors
                                if not n.startswith("model.embed_tokens") and "kv_cache" not in n
                                and not n.endswith("perm"))

    def _run(self, t: int, kv: int, rows=None, audio: bool = False) -> tuple[Tensor, Tensor]:
        """t tokens from ids[:t] at positions pos0.. (static t and kv) of cache row `rows` (default
        0) -> (logits at `last`, hidden). `audio`: where `is_audio` is set, the input embedding is
        `audio`'s row instead of the token's (a voice's turn)."""
        pos = self.pos0 + self.slots[:t]
        mask = (self.slots[None, :kv] <= pos[:, None])[None, None]
        inputs = None
        if audio:
            tokens = self.model.model.embed_tokens(self.ids[:t])
            inputs = torch.where(self.is_audio[:t, None], self.audio[:t], tokens)[None]
        logits, hidden = self.model(self.ids[None, :t], pos, mask, kv, logits_at=None,
                                    block_fns=self.fns if t == 1 else self.prompt_fns, rows=rows, inputs=inputs)
        return self.model.lm_head(hidden[0].index_select(0, self.last)).float()[0], hidden[0]

    def _decode(self) -> tuple[Tensor, Tensor]:
        """One token (id, position) from `host` on the Triton kernels (the eager layers once one of
        them failed, kernels/fallback.py) -> (logits, hidden (1, dim))."""
        self.inp.copy_(self.host, non_blocking=True)
        return self.fallback.guard(self._decode_kernels, self._decode_eager, self.device)

    def _decode_eager(self) -> tuple[Tensor, Tensor]:
        """`_decode` on the eager layers, attention over every slot up to the position read on the
        device (one graph for every position, as the kernels')."""
        pos = self.inp[1:]
        mask = (self.slots <= pos)[None, None, None]  # (1, 1, 1, max_len)
        _, hidden = self.model(self.inp[None, :1], pos, mask, self.max_len, logits_at=None)
        self.hidden.copy_(hidden[0])
        self.logits.copy_(self.model.lm_head(self.hidden).float()[0])
        return self.logits, self.hidden

    def _decode_kernels(self) -> tuple[Tensor, Tensor]:
        m = self.model.model
        x = self.triton.x  # the embedding straight into the kernels' residual stream
        torch.index_select(m.embed_tokens.weight, 0, self.inp[:1], out=x[None])
        pdl = self.triton.pdl
        _kernels("norm").rms_norm(self.triton(x, self.inp[1:]), m.norm, self.hidden[0], pdl=pdl)
        _kernels("matvec").gemv(self.lm_head, self.hidden[0], self.logits, **self.lm_head_cfg, pdl=pdl)
        return self.logits, self.hidden

    def _stage_audio(self, t: int, embeds: Tensor, embed_at: list[int]) -> None:
        """A voice's audio embeddings into the static inputs of a `t`-token prefill."""
        if self.audio is None:  # (the first voice: max_len x dim, 29 MB for the 7B in bfloat16)
            w = self.model.model.embed_tokens.weight
            self.audio = torch.zeros(self.max_len, w.shape[1], dtype=w.dtype, device=self.device)
            self.is_audio = torch.zeros(self.max_len, dtype=torch.bool, device=self.device)
        at = to_device(embed_at, self.device)
        self.is_audio[:t].zero_()
        self.is_audio.index_fill_(0, at, True)
        self.audio.index_copy_(0, at, embeds.to(self.device, self.audio.dtype))

    @torch.inference_mode()
    def forward_row(self, row: int, ids: list[int], embeds: Tensor | None = None,
                    embed_at: list[int] | None = None) -> tuple[Tensor, Tensor]:
        n = len(ids)
        if self.invariant and n == 1 and embeds is None:  # one token: the batched token's layer, alone
            logits, hidden = self.decode_rows([row], ids)
            return logits[0], hidden
        end = self._check_room(row, n)
        start = self.positions[row]
        t = n if n == 1 else _padded(n, start, self.max_len)
        kv = _bucket(start + t, LLM_BUCKET, self.max_len)
        audio = embeds is not None  # a voice's turn: its own graphs, with the embeddings spliced in
        if audio:
            self._stage_audio(t, embeds, embed_at)
        tag = ("audio",) if audio else ()
        if row > 0:  # another stream's row: the graphs of row 0's shapes, on a gathered row
            self.upload(ids, self.ids[: len(ids)])
            self.pos0.fill_(start)
            self.last.fill_(n - 1)
            self.row.fill_(row)
            logits, hidden = self.graphs.run((t, kv, "row", *tag), lambda: self._run(t, kv, self.row, audio))
        elif n == 1 and self.triton is not None and not audio:  # the position is read on the device: one graph
            if self.read is not None:
                self.read.synchronize()  # the previous token's graph has copied its inputs
            self.host_np[0], self.host_np[1] = ids[0], start
            logits, hidden = self.graphs.run("decode", self._decode)
            if self.read is not None:
                self.read.record()
        else:
            if n == 1:
                self.ids[:1].fill_(ids[0])  # no host-to-device copy (and no sync) per decoded token
            else:
                self.upload(ids, self.ids[: len(ids)])
            self.pos0.fill_(start)
            self.last.fill_(n - 1)
            logits, hidden = self.graphs.run((t, kv, *tag), lambda: self._run(t, kv, audio=audio))
        self.positions[row] = end
        return logits, hidden[:n]  # static buffers, valid until the next forward (LLMStage)

    def _prompt_shape(self, n: int, longest: int, last_start: int) -> tuple[int, int, bool] | None:
        """Up to GRAPH_PROMPT_TOKENS tokens, a graph of rows and length rounded up; beyond, the products
        outlast the launches, and exact shapes save the padding's arithmetic."""
        if n * longest > GRAPH_PROMPT_TOKENS:
            return super()._prompt_shape(n, longest, last_start)
        t = _padded(longest, last_start, self.max_len)
        return None if last_start + t > self.max_len else (batch_bucket(n, self.rows), t, True)

    def _run_prompts(self, nb: int, T: int, kv: int, graph: bool) -> tuple[Tensor, Tensor]:
        if not graph:
            return self._prompts(nb, T, kv)
        kv = _bucket(kv, LLM_BUCKET, self.max_len)
        return self.graphs.run(("prompts", nb, T, kv), lambda: self._prompts(nb, T, kv))

    @torch.inference_mode()
    def warm_batches(self, rows: int) -> None:
        """Capture the batched token's graphs of every row count up to `rows` (fresh rows' KV size), and
        row 0's single token (when it is the only stream choosing one), which a batch otherwise
        captures mid-run as streams end: 3.4 s on an H200 for the single token's first use, its Triton
        kernels compiled, every stream waiting; and the batched prompts of PROMPT_WARM_LENGTHS. Uses
        rows 0..rows-1 and resets their positions (the slots written are the next ones each row
        writes itself, or those a stream's prompt writes first)."""
        if not self.graphs.cuda:
            return
        if self.invariant:
            _invariant().warm_products(self.model)
        for nb in [1] + batch_sizes(min(rows, self.rows), self.rows):
            saved = self.positions[:nb]
            if max(saved) < self.max_len:
                self.decode_rows(list(range(nb)), [0] * nb)
            self.positions[:nb] = saved
        # the prompts of requests that arrive together, prefilled as one batch: each row bucket, at
        # the lengths of a read's or a reply's prompt, from a fresh stream's first slot (without them
        # a burst's prompts stalled every stream 371-831 ms on an H100 while their graphs were captured)
        for nb in batch_sizes(min(rows, self.rows), self.rows):
            for t in PROMPT_WARM_LENGTHS:
                shape = self._prompt_shape(nb, t, 0)
                if shape is None or not shape[2]:  # (no graph: nothing to capture)
                    continue
                saved = self.positions[:nb]
                self.positions[:nb] = [0] * nb
                self.prefill_rows(list(range(nb)), [[0] * t] * nb)
                self.positions[:nb] = saved

    def _eager_tokens(self, ids: Tensor, pos: Tensor, kv: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        """A batched token on the eager layer (its halves compiled where `batch_fns` are set)."""
        return decode_batch(self.model, ids, pos, kv, slots, self.batch_fns)

    @torch.inference_mode()
    def decode_rows(self, rows: list[int], ids: list[int]) -> tuple[Tensor, Tensor]:
        """One token for each of `rows` (distinct) in one forward over rows 0..nb-1 (cuBLAS products in
        a CUDA graph per row count and KV bucket) -> (logits (n, vocab), hidden (n, dim)) in that order.
        Row 0 alone takes the single-stream step (the Triton kernels on CUDA)."""
        if rows == [0] and self.triton is not None:
            logits, hidden = self.forward_row(0, ids)
            return logits[None], hidden
        nb = batch_bucket(max(rows) + 1, self.rows)
        tok, pos, kv = self._batch_inputs(rows, ids, nb)
        # (invariant: attention reads each row's position on the device, one graph per row count)
        kv = self.max_len if self.invariant else _bucket(kv, LLM_BUCKET, self.max_len)
        self.batch_upload((tok, pos), self.batch_in[:, :nb])
        if self.batch_fns is None and self.compile_batches:
            self.batch_fns = block_fns(dynamic=True)
        logits, hidden = self.graphs.run(("batch", nb, kv), lambda: (self.tokens or self._eager_tokens)(
            self.batch_in[0, :nb], self.batch_in[1, :nb], kv, self.slots))
        for r in rows:
            self.positions[r] += 1
        if rows[-1] == len(rows) - 1:  # rows 0..n-1
            return logits[: len(rows)], hidden[: len(rows)]
        at = to_device(rows, self.device)
        return logits.index_select(0, at), hidden.index_select(0, at)


class GraphTTSRunner(TTSRunner):
    """TTSRunner whose steps and prefills replay CUDA graphs. On CUDA a step runs the backbone with
    the Triton decode kernels (backends/kernels/decode.py: five per layer, attention bounded by the
    position read on the device, so one graph serves every position), the code heads on the Triton
    GEMV and the choice of codes in one kernel. A batched step of nb rows (one graph per nb) runs
    `batch_kernels`: "mma", the projections and code heads as tensor-core products with the rows as
    M (backends/kernels/mma.py): a row's codes do not depend on the other rows or on nb, but differ
    from its single step's (row 0 alone) by rounding; or "rows", the single step's kernels applied
    row by row (backends/kernels/batch.py), bit for bit the single step, some 0.12 ms a row on an
    H100. On a CPU, the compiled layer halves."""

    def __init__(self, model: ChatTTS, use_triton: bool | None = None, rows: int = 1, batch_kernels: str = "mma",
                 invariant: bool = False):
        if batch_kernels not in ("mma", "rows"):
            raise ValueError(f"batch_kernels must be 'mma' or 'rows', got {batch_kernels!r}")
        model.model.fuse()
        triton = use_triton if use_triton is not None else model.emb_text.weight.device.type == "cuda"
        # batch-invariant (invariant.py): prefills on the invariant products, every step (one row's
        # too) on the tensor-core kernels
        self.invariant = bool(invariant and triton)
        if self.invariant:
            batch_kernels = "mma"
            _invariant().make_invariant(model)
        super().__init__(model, block_fns=None if triton else block_fns(), rows=rows)  # (see CompiledLLM.fns)
        if triton:
            self.batch_fns = None  # (block_fns(True) once a batch runs)
        model.model.setup_rope(model.config.decoder.max_positions, self.device)
        self.graphs = Graphs(self.device)
        self.ids = torch.zeros(self.L, dtype=torch.long, device=self.device)
        self.upload = Upload((self.L,), self.device)  # text chunk ids into `ids`
        self.spk = torch.zeros(model.config.decoder.dim, dtype=self.dtype, device=self.device)
        self.begin = torch.zeros(1, dtype=torch.long, device=self.device)
        self.row = torch.zeros(1, dtype=torch.long, device=self.device)
        self.triton = self.batch = None
        self.batch_kernels = batch_kernels
        self.fallback = self.batch_fallback = None
        self._prompt_hooks = None  # (invariant: `_causal`)
        if triton:  # (tests: the interpreter)
            c = model.config
            self.triton = _kernels("decode").TritonDecode(model.model, self.visible_from)
            self.fallback = _fallback("the TTS step")
            self.batch_fallback = _fallback("the TTS's batched step")
            if not _kernels("mma").mma_fits(self.dtype, _kernels("targets").capability(self.device)):
                self.batch_kernels = batch_kernels = "rows"  # (float32 on a GPU of 99 or 163 KB a block)
            # per row: final norm, raw logits and probabilities (row 0's are the single step's)
            self.normed_b = torch.zeros(rows, c.decoder.dim, dtype=self.dtype, device=self.device)
            self.raw_b = torch.zeros(rows, c.num_vq, c.num_audio_tokens, device=self.device)
            self.probs_b = torch.zeros_like(self.raw_b)
            self.normed, self.raw, self.probs = self.normed_b[0], self.raw_b[0], self.probs_b[0]
            # the code heads on the Triton GEMV (one K-block); batched rows on `MMADecode.heads`, or on
            # `gemv_rows` with the same blocking: a row's logits do not depend on its batch (cuBLAS's would)
            self.heads = _kernels("common").Weight(model.heads.detach().view(c.num_vq * c.num_audio_tokens, -1))
            self.heads_cfg = dict(HEADS_GEMV)  # (its own: tests and sweeps change a runner's)
            # the codebooks' embeddings as one table (Q, V, hidden) for the step's input (kernels/embed.py):
            # a copy taken here (nothing changes a loaded model's weights)
            self.code_tables = torch.stack([e.weight.detach() for e in model.emb_code])
            if (rows > 1 or self.invariant) and batch_kernels == "mma":
                self.batch = _kernels("mma").MMADecode(self.triton)
            elif rows > 1 or self.invariant:
                self.batch = _kernels("batch").BatchDecode(self.triton)

    def _prefill(self, *args, **kwargs) -> None:
        with self._causal():
            super()._prefill(*args, **kwargs)

    def _prefill_batch(self, nb: int, T: int, kv: int) -> None:
        with self._causal():
            super()._prefill_batch(nb, T, kv)

    def _causal(self):
        """The text prefills' attention on `prompt_attend` when invariant (they are causal; the other
        forwards of the backbone, a continuation's frames, have a mask of their own)."""
        if not self.invariant:
            return contextlib.nullcontext()
        if self._prompt_hooks is None:
            self._prompt_hooks = _invariant().PromptHooks(self.model.model)
        return self._prompt_hooks

    def _decode(self, x: Tensor, kv_len: int) -> Tensor:
        eager = super()._decode
        if self.triton is None:
            return eager(x, kv_len)

        def eager_step():  # from the step's input as it came: a failed kernel may have left the
            # input buffer (the residual stream, which `_step_input` embeds into) half updated
            return eager(TTSRunner._step_input(self) if x is self.triton.x else x, kv_len)

        return self.fallback.guard(lambda: _kernels("norm").rms_norm(
            self.triton(x, self.pos_t), self.model.model.norm, self.normed, pdl=self.triton.pdl), eager_step,
            self.device)

    def _step_input(self) -> Tensor:
        eager = super()._step_input
        if self.triton is None:
            return eager()

        def kernel():  # (into the single step's input buffer, which it then reads in place)
            _kernels("embed").embed_codes(self.last_b[:1], self.code_tables, self.bos_b[:1], self.bos_embed,
                                          self.triton.x.view(1, -1), pdl=self.triton.pdl)
            return self.triton.x

        return self.fallback.guard(kernel, eager, self.device)

    def _logits(self, h: Tensor) -> Tensor:
        eager = super()._logits
        if self.triton is None:
            return eager(h)

        def kernel():
            _kernels("matvec").gemv(self.heads, h, self.raw.view(-1), **self.heads_cfg, pdl=self.triton.pdl)
            return self.raw

        return self.fallback.guard(kernel, lambda: eager(h), self.device)

    def _choose(self, raw: Tensor, sampled: bool) -> Tensor:
        eager = super()._choose
        if self.triton is None:
            return eager(raw, sampled)
        c = self.config

        def kernel():
            _kernels("sampling").sample_codes(raw, self.temps, self.bos_t, self.block_eos_t,
                                              self.noise_t if sampled else None, self.probs, self.code_t, c.top_p,
                                              c.top_k, MIN_KEEP)
            return self.probs

        return self.fallback.guard(kernel, lambda: eager(raw, sampled), self.device)

    def run_step(self, sampled: bool) -> tuple[Tensor, Tensor]:
        if self.invariant:  # row 0's step as a batched step of one row
            return self.graphs.run(("single", sampled), lambda: self._single_batched(sampled))
        if self.triton is not None:  # attention reads the position on the device: no KV buckets
            return self.graphs.run(("step", sampled), lambda: self._step(self.max_len, sampled))
        kv = _bucket(self.pos + 1, TTS_BUCKET, self.max_len)
        return self.graphs.run(("step", kv, sampled), lambda: self._step(kv, sampled))

    def bucket(self, n: int) -> int:
        return batch_bucket(n, self.rows)

    def _single_batched(self, sampled: bool) -> tuple[Tensor, Tensor]:
        """Row 0's step from the single-stream inputs (`*_t`, row 0 of the `*_b` tensors) on the
        batched step's kernels, its input embedding made as a batch's is (`_mma_step`)."""
        self._mma_step(1, self.last_b[:1], self.pos_b[:1], self.bos_b[:1], self.block_b[:1], sampled)
        return self.raw, self.probs

    def run_batch(self, nb: int, kv: int, sampled: bool) -> None:
        if self.triton is not None and nb == 1 and not self.invariant:  # row 0 alone: the single-stream step on the Triton kernels
            self.pos_t.copy_(self.ctl[0, :1])
            self.block_eos_t.copy_(self.ctl[1, :1] > 0)
            if sampled:
                self.noise_b[:1].copy_(self.noise_calls[self.row_ids[:1], self.ctl[3, :1]])
            self.run_step(sampled)
        elif self.batch is not None:  # attention reads each row's position on the device: no KV buckets
            self.graphs.run(("batch", nb, sampled), lambda: self.batch_step(nb, self.max_len, sampled))
        else:
            if self.batch_fns is None:
                self.batch_fns = block_fns(dynamic=True)
            kv = _bucket(kv, TTS_BUCKET, self.max_len)
            self.graphs.run(("batch", nb, kv, sampled), lambda: self.batch_step(nb, kv, sampled))
        self.advance(nb)

    @torch.inference_mode()
    def warm_batches(self, rows: int) -> None:
        """Capture, for every row count up to `rows`, the batched step (greedy and sampled) and text
        prefills of up to 64 tokens, which a batch otherwise captures mid-run (60-90 ms each on an
        H200, every stream waiting) as streams come and go; and row 0's single step, which a batch
        takes when row 0 is the only one stepping (its first use compiles Triton kernels: seconds).
        The steps leave every row as it was (no row takes part); the prefills write text slots of
        rows 0..rows-1, which every segment's start zeroes."""
        if self.batch is None:
            return
        if self.invariant:
            _invariant().warm_products(self.model)
        for nb in [1] + batch_sizes(min(rows, self.rows), self.rows):
            idle = [[min(p, self.max_len - 1) for p in self.positions[:nb]], [0] * nb, [0] * nb,
                    [FRAMES_PER_CALL] * nb]
            for sampled in (False, True):
                self.ctl_upload(idle, self.ctl[:, :nb])
                self.run_batch(nb, self.max_len, sampled)
            for t in PREFILL_BUCKETS[:3] if nb > 1 else ():  # a sentence's chunk: 16-64 tokens
                self.prefill_rows(list(range(nb)), [[0] * t] * nb, [0] * nb, [None] * nb)

    def batch_step(self, nb: int, kv: int, sampled: bool) -> None:
        if self.batch is None:
            return super().batch_step(nb, kv, sampled)
        self._mma_step(nb, *self._row_state(nb), sampled)

    def _mma_step(self, nb: int, last: Tensor, pos: Tensor, bos: Tensor, block: Tensor, sampled: bool) -> None:
        """A batched step of rows 0..nb-1 (inputs as `_row_state` gives them) on `batch`'s kernels (the eager
        layers once one of them failed, kernels/fallback.py): codes to code_b, logits and
        probabilities to raw_b, probs_b."""
        self.batch_fallback.guard(lambda: self._batch_kernels(nb, last, pos, bos, block, sampled),
                                  lambda: self._batch_eager(nb, last, pos, bos, block, sampled), self.device)

    def _batch_eager(self, nb: int, last: Tensor, pos: Tensor, bos: Tensor, block: Tensor, sampled: bool) -> None:
        m = self.model
        mask = (self.vis_b[:nb] <= pos[:, None])[:, None, None]  # (nb, 1, 1, max_len)
        x = self._embed(bos, last)
        h = m.model(x[:, None], pos[:, None], mask, self.max_len, None, rows=slice(0, nb))[:, -1]  # (nb, hidden)
        self.raw_b[:nb].copy_(m.logits(h))
        self.probs_b[:nb].copy_(self._probs(self.raw_b[:nb], bos, block))
        self.code_b[:nb].copy_(choose(self.probs_b[:nb], self.noise_b[:nb] if sampled else None))

    def _batch_kernels(self, nb: int, last: Tensor, pos: Tensor, bos: Tensor, block: Tensor, sampled: bool) -> None:
        c, pdl = self.config, self.triton.pdl
        x = _kernels("embed").embed_codes(last, self.code_tables, bos, self.bos_embed, self.batch.x[:nb], pdl=pdl)
        h = _kernels("norm").rms_norm(self.batch(x, pos, self.vis_b), self.model.model.norm, self.normed_b[:nb],
                                      pdl=pdl)
        raw = self.raw_b[:nb].view(nb, -1)
        if self.batch_kernels == "mma":
            self.batch.heads(self.heads, h, raw)
        else:
            _kernels("batch").gemv_rows(self.heads, h, raw, **self.heads_cfg, pdl=pdl)
        _kernels("sampling").sample_codes(self.raw_b[:nb], self.temps, bos, block,
                                          self.noise_b[:nb] if sampled else None, self.probs_b[:nb],
                                          self.code_b[:nb], c.top_p, c.top_k, MIN_KEEP)

    def prefill_len(self, longest: int, last_begin: int) -> int | None:
        return super().prefill_len(_padded(longest, last_begin, self.L - 1), last_begin)

    def _run_prefills(self, nb: int, T: int, kv: int) -> None:
        kv = _bucket(self.L - 1, TTS_BUCKET, self.max_len)  # every text slot (masked): fewer graphs
        self.graphs.run(("prefills", nb, T, kv), lambda: self._prefill_batch(nb, T, kv))

    @torch.inference_mode()
    def prefill_row(self, row: int, ids: list[int], begin: int, spk: Tensor | None = None) -> None:
        t = len(ids)
        kv = _bucket(begin + t, TTS_BUCKET, self.max_len)
        self.upload(ids, self.ids[: len(ids)])
        self.begin.fill_(begin)
        self.row.fill_(row)
        if spk is not None:
            self.spk.copy_(spk)
        spk_in = self.spk if spk is not None else None
        rows = None if row == 0 else self.row  # row 0 in place; another row gathered (graphs for any row)
        self.graphs.run(("prefill", t, kv, spk is not None, row == 0),
                        lambda: self._prefill(self.ids[:t], self.begin, kv, spk_in, rows))


class GraphCodec:
    """Wraps a Codec so that each decode length of up to GRAPH_FRAMES frames (streamed chunks, short
    segments) replays a CUDA graph (the DVAE and Vocos launch some hundred small kernels per chunk; in
    a graph they cost GPU time only). A longer decode, a segment decoded whole (`say` to a file, bulk),
    runs eagerly: its frames keep the kernels busy (81 MFLOP a frame in float32), and a segment's
    length is mostly its own, so a graph of it would cost two warm-up runs and a capture before its
    one replay.

    In the invariant mode a row's decode depends on its length alone (cuDNN picks a convolution's
    algorithm by the batch's size, so the length fixes the size). Decodes of up to GRAPH_FRAMES frames
    are batches of CODEC_BATCH rows; more rows than that run as that many CODEC_BATCH-row decodes side
    by side, each on a stream of its own forked from the caller's and joined back, in one graph
    (`_side_by_side`). Each is the same decode of the same rows as one after another (the same bits);
    side by side their small kernels fill the GPU together, where one after another each 8-row decode
    waited for its own launches' latency (128 rows: 16 of them, about 30 ms on an H200 before the
    first audio of 128 replies). A longer decode runs each row alone (a 377-frame line: 31 GFLOP,
    where padded to CODEC_BATCH rows it was 246)."""

    MAX_FRAMES = 4096
    SIDE_BY_SIDE = 16  # CODEC_BATCH-row decodes at most in one graph side by side (more: graphs in turn)
    # decodes in graphs: streamed chunks (25 frames, 29 with context) and short segments (each graph
    # keeps its output: up to 128 rows of these frames' samples, 16.8 MB at 64)
    GRAPH_FRAMES = 64
    # Short segments come in lengths of their own: a graph each would hold its output for good, so
    # only the most recent graphs past a streamed chunk's length are kept.
    KEPT_LENGTHS = 32

    def __init__(self, codec, invariant: bool = False):
        self.codec, self.invariant = codec, invariant
        self.decode_eager, self.batch_eager = codec.decode, codec.decode_batch
        self.codes = torch.zeros(self.MAX_FRAMES, codec.num_vq, dtype=torch.long, device=codec.device)
        self.graphs = Graphs(codec.device)
        self.inputs: dict[tuple[int, int], Tensor] = {}  # each side-by-side graph's codes
        # the groups' streams, made together: torch hands out its pooled streams in turn, and ones made
        # later (after other graphs' capture streams) could come round to the same stream again
        self.streams = [torch.cuda.Stream(codec.device) for _ in range(self.SIDE_BY_SIDE)] \
            if invariant and codec.device.type == "cuda" else []
        self.recent: OrderedDict = OrderedDict()  # the graphs of lengths past a streamed chunk's, oldest first

    def _run(self, key, t: int, fn) -> Tensor:
        """`self.graphs.run(key, fn)` for a decode of t frames, dropping the least recently used graph
        of a segment's length once more than KEPT_LENGTHS are kept (the streamed chunks' stay)."""
        if t > FRAMES_PER_CALL + StreamDecoder.CONTEXT_FRAMES:
            self.recent[key] = None
            self.recent.move_to_end(key)
            while len(self.recent) > self.KEPT_LENGTHS:
                self.graphs.drop(self.recent.popitem(last=False)[0])
        return self.graphs.run(key, fn)

    @torch.inference_mode()
    def decode(self, codes: Tensor) -> Tensor:
        t = len(codes)
        if self.invariant and t:  # (as a batch's row decodes)
            return self.decode_batch(codes[None])[0]
        if t == 0 or t > self.GRAPH_FRAMES:
            return self.decode_eager(codes)
        self.codes[:t].copy_(codes)
        return self._run(t, t, lambda: self.decode_eager(self.codes[:t])).clone()

    @torch.inference_mode()
    def decode_batch(self, codes: Tensor) -> Tensor:
        """(B, T, num_vq) -> (B, samples), one graph per (B rounded up to a power of two, T); the
        padding rows repeat the first; past GRAPH_FRAMES eagerly. Batch-invariant: up to GRAPH_FRAMES
        frames in batches of exactly CODEC_BATCH rows, longer ones each row alone (batched, the eager
        convolutions gave a row other bits beside other rows than beside copies of itself: 2,050-frame
        segments, 1e-4 apart, H100)."""
        if self.invariant:
            rows = _invariant().CODEC_BATCH
            if codes.shape[1] > self.GRAPH_FRAMES:
                return torch.cat([self.batch_eager(row[None]) for row in codes])
            if len(codes) > rows:
                return self._side_by_side(codes)
            return _invariant().fixed_batches(codes, self._decode_batch)
        if codes.shape[1] > self.GRAPH_FRAMES:
            return self.batch_eager(codes)
        return self._decode_batch(codes)

    def _side_by_side(self, codes: Tensor) -> Tensor:
        """(n, T, num_vq), n > CODEC_BATCH -> (n, samples): the n rows in groups of CODEC_BATCH (the last
        padded with copies of the first row), the groups side by side in one graph per (a power of two
        of groups, T); past SIDE_BY_SIDE groups, such graphs one after another."""
        rows = _invariant().CODEC_BATCH
        most = self.SIDE_BY_SIDE * rows
        if len(codes) > most:
            return torch.cat([self.decode_batch(codes[i : i + most]) for i in range(0, len(codes), most)])
        n, t = codes.shape[:2]
        k = batch_bucket(-(-n // rows), self.SIDE_BY_SIDE)
        key = (k, t)
        buf = self.inputs.get(key)
        if buf is None:
            buf = self.inputs[key] = torch.zeros(k * rows, t, self.codec.num_vq, dtype=torch.long,
                                                 device=self.codec.device)
        buf[:n].copy_(codes)
        buf[n:].copy_(codes[:1].expand(k * rows - n, -1, -1))
        return self._run(("side by side", k, t), t, lambda: self._groups(buf, k, rows))[:n].clone()

    def _groups(self, buf: Tensor, k: int, rows: int) -> Tensor:
        """`batch_eager` of each CODEC_BATCH-row group of `buf`, each on its own stream (on a GPU)."""
        if not self.streams:
            return torch.cat([self.batch_eager(buf[i * rows : (i + 1) * rows]) for i in range(k)])
        caller = torch.cuda.current_stream()
        outs, forked = [], []
        try:
            for i, stream in enumerate(self.streams[:k]):
                stream.wait_stream(caller)
                forked.append(stream)
                with torch.cuda.stream(stream):
                    outs.append(self.batch_eager(buf[i * rows : (i + 1) * rows]))
        finally:  # (joined even after an error: a capture with a stream left out fails on that instead)
            for stream in forked:
                caller.wait_stream(stream)
        return torch.cat(outs)

    def _decode_batch(self, codes: Tensor) -> Tensor:
        n, t = codes.shape[:2]
        nb = batch_bucket(n, n * 2)
        if nb * t > self.MAX_FRAMES:
            return self.batch_eager(codes)
        rows = self.codes[: nb * t].view(nb, t, -1)
        rows[:n].copy_(codes)
        rows[n:].copy_(codes[:1].expand(nb - n, -1, -1))
        return self._run((nb, t), t, lambda: self.batch_eager(rows))[:n].clone()

    def warm_batches(self, rows: int) -> None:
        """Capture the batched decodes of a streamed chunk (the first, and a later one with its left
        context) for every row count a batch of up to `rows` streams reaches."""
        if self.invariant:  # (one group, and the side-by-side groups up to `rows` rows)
            group = _invariant().CODEC_BATCH
            counts = [group] + [k * group for k in batch_sizes(-(-rows // group), self.SIDE_BY_SIDE)]
        else:
            counts = batch_sizes(rows, 2 * rows)
        for nb in counts:
            for t in (FRAMES_PER_CALL, FRAMES_PER_CALL + StreamDecoder.CONTEXT_FRAMES):
                self.decode_batch(torch.zeros(nb, t, self.codec.num_vq, dtype=torch.long, device=self.codec.device))


def create(ckpt: Checkpoint, config: dict, *, device, dtype, max_len: int, rows: int = 1, invariant: bool = False,
           **options) -> CompiledLLM:
    return CompiledLLM(build(ckpt, config, device=device, dtype=dtype), max_len, rows=rows, invariant=invariant)


def tts_runner(model: ChatTTS, rows: int = 1, invariant: bool = False) -> GraphTTSRunner:
    return GraphTTSRunner(model, rows=rows, invariant=invariant)


def wrap_codec(codec, invariant: bool = False) -> None:
    """Route `codec.decode` and `decode_batch` through CUDA graphs (`invariant`: in batches of one
    size), and give it `warm_batches` (on a CPU nothing changes)."""
    if codec.device.type == "cuda":
        graphs = GraphCodec(codec, invariant)
        codec.decode, codec.decode_batch, codec.warm_batches = graphs.decode, graphs.decode_batch, graphs.warm_batches
