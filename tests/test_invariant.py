"""Batch invariance (backends/invariant.py): a stream's arithmetic does not depend on its batch.

Without a GPU the invariant kernels run in Triton's interpreter (conftest) on the tiny checkpoint,
float32 and bfloat16: the LLM's prompts and tokens, alone and batched at other rows, give the same
logits and hidden states to the bit; so do the TTS runner's steps and prefills. `invariant_mm`'s rows
do not depend on the tile or the number of tokens. On a GPU (marked `gpu`): the same at the 7B's
shapes, and whole requests alone and batched (sizes 3 and 16, shuffled, a mid-flight join) give equal
codes and samples.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

pytest.importorskip("triton")

from minicpm_cli.backends.compile import CompiledLLM, GraphCodec, GraphTTSRunner
from minicpm_cli.backends.invariant import (CODEC_BATCH, InvariantLinear, InvariantRMSNorm, InvariantUnitNorm,
                                           fixed_batches, make_invariant)
from minicpm_cli.backends.kernels.gemm import invariant_mm, mm_config
from minicpm_cli.engine.batching import Stream
from minicpm_cli.engine.pipeline import Synthesizer
from minicpm_cli.models.chattts import UnitNorm
from minicpm_cli.models.transformer import RMSNorm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = "<|im_start|>user\nHello world, how are you?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_rows_do_not_depend_on_tile_or_count(dtype):
    torch.manual_seed(0)
    w, b = torch.randn(40, 96, device=DEVICE).to(dtype), torch.randn(40, device=DEVICE).to(dtype)
    x = torch.randn(37, 96, device=DEVICE).to(dtype)
    ref = invariant_mm(x, w, b, cfg=(16, 16, 64, 4, 3))
    assert (ref.float() - torch.nn.functional.linear(x.float(), w.float(), b.float())).abs().max() < 0.5
    for cfg in [(32, 64, 64, 4, 3), (64, 16, 64, 4, 3), (16, 32, 128, 8, 4), (128, 16, 256, 4, 2)]:  # (each fits an H100's shared memory)
        assert torch.equal(invariant_mm(x, w, b, cfg=cfg), ref)
        assert torch.equal(invariant_mm(x[5:9], w, b, cfg=cfg), ref[5:9])
        assert torch.equal(invariant_mm(x[7:8], w, b, cfg=cfg), ref[7:8])


def test_make_invariant_swaps_linears_and_norms_in_place():
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Sequential(torch.nn.Linear(3, 2)), RMSNorm(2, 1e-6),
                            torch.nn.ReLU(), UnitNorm())
    w = m[0].weight
    make_invariant(m)
    assert type(m[0]) is InvariantLinear and type(m[1][0]) is InvariantLinear and m[0].weight is w
    assert type(m[2]) is InvariantRMSNorm and type(m[3]) is torch.nn.ReLU and type(m[4]) is InvariantUnitNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unit_norm_is_normalize_a_row_at_a_time(dtype):
    """The speaker vectors' kernel: F.normalize's values (its rounding of the norm included), each
    row's bits the same alone as among others, a zero row left zero."""
    torch.manual_seed(0)
    x = (torch.randn(5, 768, device=DEVICE) * torch.tensor([1, 10, 0.01, 3, 0], device=DEVICE)[:, None]).to(dtype)
    norm = InvariantUnitNorm()
    got = norm(x)
    ref = torch.nn.functional.normalize(x.float(), dim=-1)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7  # (the interpreter truncates to bfloat16)
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)
    assert not got[4].any()
    for i in range(5):
        assert torch.equal(norm(x[i : i + 1])[0], got[i])
    assert torch.equal(norm(x[1]), got[1])  # (a vector: one row)


def test_fixed_batches_pads_to_one_size():
    seen = []

    def decode(part):
        seen.append(len(part))
        return part.sum((1, 2)).float()[:, None]

    codes = torch.arange(11 * 2 * 4).view(11, 2, 4)
    out = fixed_batches(codes, decode, rows=4)
    assert seen == [4, 4, 4] and torch.equal(out[:, 0], codes.sum((1, 2)).float())


class FakeCodec:
    """A codec whose audio is each frame's code sum twice; it records the (rows, frames) it decodes."""

    num_vq, device = 4, torch.device("cpu")

    def __init__(self, seen: list):
        self.seen = seen

    def decode(self, codes):
        return self.decode_batch(codes[None])[0]

    def decode_batch(self, codes):
        self.seen.append(tuple(codes.shape[:2]))
        return codes.sum(2).float().repeat_interleave(2, 1)


def test_invariant_codec_decodes_long_segments_row_by_row():
    """Streamed chunks and short segments (up to GRAPH_FRAMES) are decoded in batches of
    CODEC_BATCH rows; a longer segment each row alone and eagerly, with or without others of its
    length (its frames computed once, not padded to CODEC_BATCH rows, and no graph captured for a
    length of its own), so that its audio is the same decoded alone or with others."""
    seen = []

    graphs = GraphCodec(FakeCodec(seen), invariant=True)
    chunk, short = GraphCodec.GRAPH_FRAMES, GraphCodec.GRAPH_FRAMES + 1
    for long in (short, GraphCodec.MAX_FRAMES // CODEC_BATCH, GraphCodec.MAX_FRAMES // CODEC_BATCH + 1):
        seen.clear()
        codes = torch.randint(0, 100, (3, long, 4))
        out = graphs.decode_batch(codes)
        assert seen == [(1, long)] * 3 and torch.equal(out, codes.sum(2).float().repeat_interleave(2, 1))
        seen.clear()
        assert torch.equal(graphs.decode(codes[1]), out[1]) and seen == [(1, long)]
    seen.clear()
    graphs.decode_batch(torch.zeros(3, chunk, 4, dtype=torch.long))
    assert seen == [(CODEC_BATCH, chunk)]
    seen.clear()
    assert graphs.decode(torch.ones(chunk, 4, dtype=torch.long)).shape == (chunk * 2,) and seen == [(CODEC_BATCH, chunk)]
    assert list(graphs.recent) == [(CODEC_BATCH, chunk)]  # (no graph for a segment's own length)


def test_invariant_codec_runs_groups_side_by_side(monkeypatch):
    """More rows than CODEC_BATCH of a short length: groups of CODEC_BATCH rows (the last padded),
    up to SIDE_BY_SIDE of them in one graph (streams of their own on a GPU), the rest in turn; each
    row's audio is its own group's decode, as one row alone gets it."""
    seen = []

    monkeypatch.setattr(GraphCodec, "SIDE_BY_SIDE", 2)
    graphs = GraphCodec(FakeCodec(seen), invariant=True)
    t = GraphCodec.GRAPH_FRAMES
    codes = torch.randint(0, 100, (2 * CODEC_BATCH + 3, t, 4))
    out = graphs.decode_batch(codes)
    assert torch.equal(out, codes.sum(2).float().repeat_interleave(2, 1))
    assert seen == [(CODEC_BATCH, t)] * 3  # two side by side, then the last 3 rows padded
    assert list(graphs.inputs) == [(2, t)] and torch.equal(graphs.inputs[2, t][:2 * CODEC_BATCH],
                                                           codes[:2 * CODEC_BATCH])
    seen.clear()
    graphs.decode_batch(codes[: CODEC_BATCH + 1, : t - 1])  # (9 rows: two groups, the second padded)
    assert seen == [(CODEC_BATCH, t - 1)] * 2 and (2, t - 1) in graphs.inputs
    assert torch.equal(graphs.inputs[2, t - 1][CODEC_BATCH + 1 :], codes[:1, : t - 1].expand(CODEC_BATCH - 1, -1, -1))
    seen.clear()
    graphs.decode_batch(torch.zeros(CODEC_BATCH + 1, t + 1, 4, dtype=torch.long))  # (longer: each row alone)
    assert seen == [(1, t + 1)] * (CODEC_BATCH + 1) and (2, t + 1) not in graphs.inputs
    seen.clear()
    monkeypatch.setattr(GraphCodec, "SIDE_BY_SIDE", 4)  # (3 groups: a graph of 4, the 4th all padding)
    out = graphs.decode_batch(codes)
    assert torch.equal(out, codes.sum(2).float().repeat_interleave(2, 1))
    assert seen == [(CODEC_BATCH, t)] * 4 and torch.equal(graphs.inputs[4, t][3 * CODEC_BATCH :],
                                                          codes[:1].expand(CODEC_BATCH, -1, -1))


def _llm(tiny_dir, dtype: str, rows: int = 4) -> CompiledLLM:
    s = Synthesizer.load(str(tiny_dir), backend="eager", device=DEVICE, dtype=dtype)
    return s, CompiledLLM(s.llm.model, max_len=256, use_triton=True, rows=rows, invariant=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llm_prompt_and_tokens_alone_equal_batched(tiny_dir, dtype):
    """Row 0 alone (prompt, then 3 tokens one at a time) against the same prompt at row 2 of a
    batched prefill with two other prompts, and its tokens in batched steps with other rows."""
    s, llm = _llm(tiny_dir, dtype)
    tok = s.tokenizers.encode_llm
    ids, other1, other2 = tok(PROMPT), tok("<|im_start|>user\nHi<|im_end|>\n"), tok(PROMPT + "Sure, here")
    logits, hidden = llm.forward_row(0, ids)
    alone = [(logits.clone(), hidden.clone())]
    for t in (5, 17, 3):
        logits, hidden = llm.forward_row(0, [t])
        alone.append((logits.clone(), hidden.clone()))
    for r in range(4):
        llm.reset_row(r)
    outs = llm.prefill_rows([0, 1, 2], [other1, other2, ids])
    batched = [(outs[2][0].clone(), outs[2][1].clone())]
    for t in (5, 17, 3):
        logits, hidden = llm.decode_rows([0, 2, 3], [9, t, 11])
        batched.append((logits[1].clone(), hidden[1:2].clone()))
    for (la, ha), (lb, hb) in zip(alone, batched):
        assert torch.equal(la, lb)
        assert torch.equal(ha, hb)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_tokens_are_the_eager_layer_to_the_bit(tiny_dir, dtype):
    """`FusedTokens`' kernels (nine launches a layer) against the eager layer they replace
    (`decode_batch` on the invariant modules), from the same caches: logits, hidden states and the
    K/V they write, equal on a GPU; three prefilled rows for two tokens, then one row at the last
    slot. In the interpreter float32 is equal up to torch's CPU SiLU (another exp), bfloat16 only
    close (the interpreter rounds to bfloat16 by truncation)."""
    from minicpm_cli.backends.eager import decode_batch
    from minicpm_cli.backends.invariant import FusedTokens

    s, llm = _llm(tiny_dir, dtype)
    assert isinstance(llm.tokens, FusedTokens)
    tok = s.tokenizers.encode_llm
    llm.prefill_rows([0, 1, 2], [tok(PROMPT), tok("<|im_start|>user\nHi<|im_end|>\n"), tok(PROMPT + "Sure")])
    caches = [layer.self_attn.kv_cache for layer in llm.model.model.layers]
    pos = [llm.positions[r] for r in range(3)]
    for t, p in (((5, 17, 3), pos), ((9, 2, 40), [x + 1 for x in pos]), ((7,), [llm.max_len - 1])):
        ids, p = torch.tensor(t, device=llm.device), torch.tensor(p, device=llm.device)
        before = [(c.k.clone(), c.v.clone()) for c in caches]
        fused = [out.clone() for out in llm.tokens._kernels(ids, p)]  # (the kernels: no fallback between)
        fused_kv = [(c.k.clone(), c.v.clone()) for c in caches]
        for c, (k, v) in zip(caches, before):
            c.k.copy_(k)
            c.v.copy_(v)
        eager = decode_batch(llm.model, ids, p, llm.max_len, llm.slots)
        assert not torch.equal(fused_kv[0][0], before[0][0])  # (the token wrote its K)
        if DEVICE == "cuda":
            assert torch.equal(fused[0], eager[0]) and torch.equal(fused[1], eager[1])
            for c, (k, v) in zip(caches, fused_kv):
                assert torch.equal(c.k, k) and torch.equal(c.v, v)
        elif dtype == "float32":  # the first layer's K/V (before any SiLU) to the bit, the rest close
            assert torch.equal(caches[0].k, fused_kv[0][0]) and torch.equal(caches[0].v, fused_kv[0][1])
            torch.testing.assert_close(fused[0], eager[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(fused[1], eager[1], rtol=1e-4, atol=1e-4)
        else:
            assert torch.nn.functional.cosine_similarity(fused[0], eager[0], dim=-1).min() > 0.99


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_prompt_is_the_eager_layer_to_the_bit(tiny_dir, dtype):
    """`FusedPrompt`'s layer halves (the rotary in place, o with the residual and the RMSNorm, SiLU *
    up) against the eager `Block`'s, from the same caches: hidden states and the K/V written, one
    prompt at row 0 and two at rows 1 and 2 (positions a row each), equal on a GPU; in the
    interpreter as `FusedTokens`' test; also two rows at the same positions. The residual stream
    passed in is left as it was."""
    from minicpm_cli.backends.invariant import FusedPrompt

    s, llm = _llm(tiny_dir, dtype)
    assert llm.prompt_fns == FusedPrompt.fns()
    model, dev = llm.model, llm.device
    ids = torch.tensor([s.tokenizers.encode_llm(PROMPT)], device=dev)
    t = ids.shape[1]
    slots = torch.arange(t + 8, device=dev)
    caches = [layer.self_attn.kv_cache for layer in model.model.layers]
    cases = ((slots[:t], slice(0, 1), 1), (slots[:t] + 3, slice(1, 3), 2),  # (one row, two at one position)
             (torch.stack([slots[:t] + 5, slots[:t]]), torch.tensor([1, 2], device=dev), 2))  # (a position each)
    for pos, rows, b in cases:
        x = model.model.embed_tokens(ids.expand(b, -1)).clone()
        x0 = x.clone()
        kv = int(pos.max()) + 1
        mask = slots[:kv] <= pos[..., None]
        mask = mask[None, None] if pos.dim() == 1 else mask[:, None]
        before = [(c.k.clone(), c.v.clone()) for c in caches]
        fused = model.model(x, pos, mask, kv, block_fns=(FusedPrompt._pre, FusedPrompt._post), rows=rows)
        assert torch.equal(x, x0)
        fused_kv = [(c.k.clone(), c.v.clone()) for c in caches]
        for c, (k, v) in zip(caches, before):
            c.k.copy_(k)
            c.v.copy_(v)
        eager = model.model(x, pos, mask, kv, rows=rows)
        assert not torch.equal(fused_kv[0][0], before[0][0])
        if DEVICE == "cuda":
            assert torch.equal(fused, eager)
            for c, (k, v) in zip(caches, fused_kv):
                assert torch.equal(c.k, k) and torch.equal(c.v, v)
        elif dtype == "float32":  # the first layer's K/V (before any SiLU) to the bit, the rest close
            assert torch.equal(caches[0].k, fused_kv[0][0]) and torch.equal(caches[0].v, fused_kv[0][1])
            torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)
        else:
            # (hidden states, not logits: the interpreter's truncations add up over the layers)
            assert torch.nn.functional.cosine_similarity(fused.float(), eager.float(), dim=-1).min() > 0.97


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llm_prompt_after_a_context_alone_equal_batched(tiny_dir, dtype):
    """A prompt after a kept context (a voice's turn: 100 tokens over several blocks of slots),
    alone at row 0 and at row 2 of a batched prefill beside a fresh prompt and another context's:
    the same logits and hidden states (SDPA's masked path differed here on an H100)."""
    s, llm = _llm(tiny_dir, dtype)
    tok = s.tokenizers.encode_llm
    context = (tok(PROMPT) * 8)[:100]
    llm.forward_row(0, context)
    kept = llm.save_prefix_row(0)
    ids = tok("<|im_start|>user\nAnd now?<|im_end|>\n")
    logits, hidden = llm.forward_row(0, ids)
    alone = logits.clone(), hidden.clone()
    llm.reset_row(0)
    llm.load_prefix_row(1, llm.save_prefix_row(0))  # (an empty context)
    llm.load_prefix_row(2, kept)
    outs = llm.prefill_rows([0, 1, 2], [tok(PROMPT), tok(PROMPT + "Sure"), ids])
    assert torch.equal(outs[2][0], alone[0]) and torch.equal(outs[2][1], alone[1])


def test_prompt_attention_is_attention_and_row_exact():
    """`PromptAttention` against SDPA (causal from each sequence's start, grouped heads), and a
    sequence's rows the same alone, padded, beside others and at another cache row."""
    from minicpm_cli.backends.invariant import PromptAttention
    from minicpm_cli.models.transformer import KVCache

    torch.manual_seed(0)
    H, Hkv, D, S = 4, 2, 16, 160
    cache = KVCache(S, Hkv, D, torch.float32, DEVICE, rows=3)
    cache.k.normal_(), cache.v.normal_()
    attn = PromptAttention(cache, H)
    q = torch.randn(2, H, 70, D, device=DEVICE)
    start = torch.tensor([[80], [3]], device=DEVICE) + torch.arange(70, device=DEVICE)
    both = attn(cache, q, start, torch.tensor([2, 0], device=DEVICE))
    for b, row in ((0, 2), (1, 0)):
        k = cache.k[row, :, : int(start[b, -1]) + 1].repeat_interleave(H // Hkv, 0)
        v = cache.v[row, :, : int(start[b, -1]) + 1].repeat_interleave(H // Hkv, 0)
        mask = torch.arange(k.shape[1], device=DEVICE)[None] <= start[b][:, None]
        ref = torch.nn.functional.scaled_dot_product_attention(q[b], k, v, attn_mask=mask)
        assert (both[b].view(70, H, D).transpose(0, 1) - ref).abs().max() < 1e-4
    alone = attn(cache, q[:1, :, :9], start[0, :9], slice(2, 3))  # 9 queries, one block, row 2
    assert torch.equal(alone[0], both[0, :9])
    assert torch.equal(attn(cache, q[1:, :, :40], start[1:, :40], slice(0, 1))[0], both[1, :40])


def test_tts_steps_alone_equal_batched(tiny_dir):
    """The invariant TTS runner: row 0's single-stream steps equal its steps batched with other rows
    (bfloat16, interpreter), after the same text prefill alone and batched."""
    s = Synthesizer.load(str(tiny_dir), backend="eager", device=DEVICE, dtype="bfloat16")
    cond = s.tokenizers.condition("Hello there, how are you doing today?", s.tts_model.config.streaming_text_reserved_len)
    spk = torch.nn.functional.normalize(torch.randn(s.tts_model.config.decoder.dim), dim=0).to(DEVICE, torch.bfloat16)
    ids = cond.ids[: cond.n + 3]
    runner = GraphTTSRunner(copy.deepcopy(s.tts_model), use_triton=True, rows=3, invariant=True)
    layers = runner.model.model.layers

    def text_kv(row):
        return [c[row, :, : runner.L].clone() for layer in layers for c in (layer.self_attn.kv_cache.k,
                                                                             layer.self_attn.kv_cache.v)]

    runner.start(cond.n)
    runner.prefill(ids, 0, spk)
    kv_alone = text_kv(0)
    alone, _ = runner.generate(None, n_steps=3, min_new=3)
    for r in range(3):
        runner.start_row(r, cond.n)
    # a longer text beside it: row 1's chunk is padded in the batched forward
    other = s.tokenizers.condition("A different and much longer sentence, with a few more words in it than the first.",
                                   s.tts_model.config.streaming_text_reserved_len)
    assert other.n > cond.n
    runner.prefill_rows([0, 1, 2], [other.ids[: other.n + 3], ids, other.ids[: other.n + 3]], [0, 0, 0],
                        [spk.flip(0), spk, None])
    assert all(torch.equal(a, b) for a, b in zip(kv_alone, text_kv(1)))  # the padding's slots too
    calls = [runner.call(r, None, n_steps=3, min_new=3) for r in range(3)]
    while any(c.result is None for c in calls):
        runner.step_calls([c for c in calls if c.result is None])
    assert torch.equal(calls[1].result[0], alone)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speaker_vectors_alone_equal_batched(tiny_dir, dtype):
    """The invariant runner projects a round's speaker vectors in one batch (interpreter): each row
    what it gets alone, and the projection's values."""
    s = Synthesizer.load(str(tiny_dir), backend="eager", device=DEVICE, dtype=dtype)
    runner = GraphTTSRunner(copy.deepcopy(s.tts_model), use_triton=True, rows=1, invariant=True)
    assert runner.invariant and not s.tts.invariant  # (the eager runner projects a row at a time)
    torch.manual_seed(0)
    h = torch.randn(5, s.tts_model.config.llm_dim) * 3
    batched = runner.speakers(h)
    for i in range(5):
        assert torch.equal(runner.speaker(h[i]), batched[i])
    with torch.inference_mode():
        ref = torch.nn.functional.normalize(s.tts_model.projector(h.to(DEVICE, runner.dtype)).float(), dim=-1)
    tol = 1e-5 if dtype == "float32" else 0.05
    torch.testing.assert_close(batched.float(), ref, rtol=tol, atol=tol)


# --- on a GPU ---

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944),
          "lm_head": (151700, 3584), "tts_qkv": (2304, 768), "tts_down": (768, 3072)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_product_rows_equal_at_every_token_count_on_gpu(name):
    """Every `mm_config` configuration at the 7B's (and the TTS's) shapes: a row's output is the
    same at 1 ... 1024 tokens, bfloat16 on the tensor cores."""
    n, k = SHAPES[name]
    torch.manual_seed(0)
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if "qkv" in name else None
    x = torch.randn(1024 if name != "lm_head" else 128, k, device="cuda", dtype=torch.bfloat16)
    ref = invariant_mm(x, w, b)
    counts = [1, 2, 7, 16, 17, 32, 33, 64, 65, 128, 129, 200, 256, 257, 300, 512, 513, 1024]
    assert len({mm_config(m, n, k) for m in counts}) >= (2 if name == "lm_head" else 4)
    for m in counts:
        if m <= len(x):
            assert torch.equal(invariant_mm(x[:m], w, b), ref[:m]), m
            assert torch.equal(invariant_mm(x[m // 2 : m], w, b), ref[m // 2 : m]), m


def _run(synth, engine, reqs, order, join_after=None):
    got = {k: [] for k in order}

    def submit(ks):
        for k in ks:
            engine.submit(Stream(lambda lane, k=k: _request(synth, *reqs[k], lane), got[k].append))

    submit(order if join_after is None else order[: len(order) // 2])
    if join_after is not None:
        for _ in range(join_after):
            engine.round()
        submit(order[len(order) // 2:])
    engine.run()
    return {k: _result(v) for k, v in got.items()}


def _request(synth, kind, text, seed, lane=None):
    """The bench's request, lengths forced (seed None: greedy)."""
    from minicpm_cli.cli import bench

    return bench.request_stream(synth, kind, text, seed, bench.BenchOptions(random_weights=True), lane=lane)


def _result(chunks):
    import numpy as np

    return (torch.cat([c.codes for c in chunks]), "".join(c.text for c in chunks),
            np.concatenate([c.samples for c in chunks]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_codec_groups_side_by_side_are_each_row_alone_on_gpu(tiny_dir):
    """The invariant codec's CODEC_BATCH-row groups on streams of their own in one graph (captured at
    warm-up, replayed here on other codes): each row's samples are its decode alone, to the bit, at
    17, 40 and 128 rows (3, 5 and 16 groups), first chunks and later ones."""
    synth = Synthesizer.load(str(tiny_dir), device="cuda", dtype="float32", backend="compile", rows=128)
    synth.codec.warm_batches(128)
    assert len({s.cuda_stream for s in synth.codec.decode_batch.__self__.streams}) == GraphCodec.SIDE_BY_SIDE
    torch.manual_seed(0)
    for n, t in [(17, 25), (40, 29), (128, 29)]:
        codes = torch.randint(0, 600, (n, t, synth.codec.num_vq), device="cuda")
        together = synth.codec.decode_batch(codes)
        for i in range(n):
            assert torch.equal(together[i], synth.codec.decode(codes[i])), (n, i)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_codec_segments_alone_equal_batched_on_gpu(tiny_dir):
    """Segments longer than GRAPH_FRAMES are each decoded as a batch of one, eagerly: a row's
    samples are the same decoded with others of its length as alone, to the bit."""
    synth = Synthesizer.load(str(tiny_dir), device="cuda", dtype="float32", backend="compile", rows=4)
    torch.manual_seed(0)
    for t in (GraphCodec.GRAPH_FRAMES + 1, 377, 600):
        codes = torch.randint(0, 600, (3, t, synth.codec.num_vq), device="cuda")
        together = synth.codec.decode_batch(codes)
        for i in range(3):
            assert torch.equal(together[i], synth.codec.decode(codes[i])), (t, i)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["compile", "int4"])
def test_requests_alone_equal_batched_on_gpu(backend):
    """16 of the benchmark's reads and replies, greedy and seeded, full-size random weights in
    bfloat16: alone, in batches of 3 and of 16 (shuffled rows), and half of them joining mid-flight
    give the same codes, reply text and samples, to the bit."""
    import numpy as np

    from minicpm_cli.cli import bench

    kinds = [("read", t) for t in bench.READ_TEXTS] + [("reply", t) for t in bench.REPLY_PROMPTS]
    kinds = [kinds[k % len(kinds)] for k in range(16)]
    synth = Synthesizer.load(None, backend=backend, random_weights=True, rows=16)
    engine = synth.batch()
    rng = random.Random(0)
    for greedy in (True, False):
        reqs = [(kind, text, None if greedy else 100 + k) for k, (kind, text) in enumerate(kinds)]
        alone = {k: _result(list(_request(synth, *r))) for k, r in enumerate(reqs)}
        order = list(range(16))
        rng.shuffle(order)
        runs = [{k: v for i in range(0, 16, 3) for k, v in _run(synth, engine, reqs, order[i : i + 3]).items()},
                _run(synth, engine, reqs, order), _run(synth, engine, reqs, order[::-1], join_after=40)]
        for got in runs:
            for k, (codes, text, samples) in got.items():
                a_codes, a_text, a_samples = alone[k]
                assert torch.equal(codes, a_codes) and text == a_text, (greedy, k)
                assert np.array_equal(samples, a_samples), (greedy, k)
