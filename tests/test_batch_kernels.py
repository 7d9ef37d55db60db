"""The batched Triton decode step (backends/kernels/batch.py) against the single-stream one: each
row of a batch, at its own position and with its own visibility, gives bit for bit what
`TritonDecode` gives it alone (float32 and bfloat16), and so do the final norm, the code heads and
the choice of codes; the TTS runner's batched steps equal its single steps. The tensor-core step
(backends/kernels/mma.py): each row of a batch gives bit for bit what it gives in a batch of another
size with other rows, and stays close to the eager decoder. Without a GPU the kernels run in
Triton's interpreter (conftest)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from minicpm_cli.backends.compile import GraphTTSRunner
from minicpm_cli.backends.kernels.batch import BatchDecode, gemv_rows
from minicpm_cli.backends.kernels.common import Weight
from minicpm_cli.backends.kernels.decode import TritonDecode, kernels_scratch
from minicpm_cli.backends.kernels.matvec import gemv
from minicpm_cli.backends.kernels.mma import MMADecode, mma_rows
from minicpm_cli.backends.kernels.norm import rms_norm
from minicpm_cli.backends.kernels.sampling import sample_codes
from minicpm_cli.models.transformer import Decoder, DecoderConfig
from minicpm_cli.engine.pipeline import Synthesizer
from minicpm_cli.engine.tts import MIN_KEEP

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX = 48
ROWS = 4
# several K-blocks in every projection, o and down split over K (as tests/test_kernels.py's split)
BLOCKS = {"qkv": (8, 16, 4, 1), "o": (8, 16, 4, 1, 2), "gate_up": (8, 32, 4, 1), "down": (8, 16, 4, 1, 2)}


def decoder(dtype, gqa: bool, bias: bool) -> Decoder:
    """A fused decoder with a random KV cache of ROWS rows."""
    torch.manual_seed(0)
    c = DecoderConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2 if gqa else 4, intermediate=96,
                      rope_theta=10000.0, norm_eps=1e-6, qkv_bias=bias, max_positions=256)
    d = Decoder(c)
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.3)
    d = d.to(DEVICE, dtype)
    d.fuse()
    d.setup_cache(MAX, dtype, DEVICE, ROWS)
    d.setup_rope(256, DEVICE)
    for layer in d.layers:
        layer.self_attn.kv_cache.k.normal_()
        layer.self_attn.kv_cache.v.normal_()
    return d


def alone(d: Decoder, row: int, vis, cfg) -> tuple[TritonDecode, Decoder]:
    """A copy of d whose one-row cache is row `row` of d's, on TritonDecode."""
    one = copy.deepcopy(d)
    for layer, src in zip(one.layers, d.layers):
        layer.self_attn.kv_cache.k = src.self_attn.kv_cache.k[row : row + 1].clone()
        layer.self_attn.kv_cache.v = src.self_attn.kv_cache.v[row : row + 1].clone()
    td = TritonDecode(one, vis)
    td.block_s = 16  # attention over several cache blocks and splits
    if cfg is not None:
        td.cfg = cfg
        td.scratch = kernels_scratch(cfg, td.weights[0][1], td.weights[0][3], DEVICE)
    return td, one


@pytest.mark.parametrize("dtype,gqa,bias,masked,cfg", [
    (torch.float32, True, True, True, None),
    (torch.bfloat16, False, False, True, None),
    (torch.bfloat16, True, True, False, BLOCKS),
])
def test_batched_step_rows_equal_each_row_alone(dtype, gqa, bias, masked, cfg):
    d = decoder(dtype, gqa, bias)
    gen = torch.Generator().manual_seed(1)
    pos = torch.tensor([20, 5, 45, 33], device=DEVICE)  # rows at their own positions
    # per row: some slots never seen, the others from a position of their own (the TTS chunk mask)
    vis = torch.where(torch.rand(ROWS, MAX, generator=gen) < 0.3, 10**6, torch.randint(0, 40, (ROWS, MAX), generator=gen))
    vis = vis.to(DEVICE) if masked else None
    x = torch.randn(ROWS, 64, generator=gen).to(DEVICE, dtype)
    refs = [alone(d, b, vis[b] if masked else None, cfg) for b in range(ROWS)]
    single = TritonDecode(d, None)
    single.block_s = 16
    if cfg is not None:
        single.cfg = cfg
    batch = BatchDecode(single, group=2)  # two step rows a program, two programs
    with torch.inference_mode():
        out = batch(x, pos, vis).clone()
        assert not batch.count.any() and not batch.scratch.count.any()  # split counters back to zero
        for b, (td, one) in enumerate(refs):
            ref = td(x[b], pos[b : b + 1])
            assert torch.equal(out[b], ref), f"row {b}"
            for lb, lo in zip(d.layers, one.layers):  # the row's new K/V, in its own cache row
                assert torch.equal(lb.self_attn.kv_cache.k[b], lo.self_attn.kv_cache.k[0])
                assert torch.equal(lb.self_attn.kv_cache.v[b], lo.self_attn.kv_cache.v[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_heads_and_codes_of_rows_equal_each_row_alone(dtype):
    """The end of a TTS step: final norm, code heads (with split-K too) and the choice of codes."""
    torch.manual_seed(2)
    q, v, dim, nb = 4, 50, 64, 4
    norm = SimpleNamespace(weight=torch.randn(dim, device=DEVICE).to(dtype), eps=1e-6)
    w = Weight(torch.randn(q * v, dim, device=DEVICE).to(dtype))
    h = torch.randn(nb, dim, device=DEVICE).to(dtype)
    temps = torch.tensor([0.1, 0.3, 0.1, 0.3], device=DEVICE)[:, None]
    bos = torch.tensor([[True], [False], [False], [False]], device=DEVICE)
    block = torch.tensor([[False], [True], [False], [True]], device=DEVICE)
    noise = torch.empty(nb, q, v, device=DEVICE).exponential_()
    normed = rms_norm(h, norm, torch.empty_like(h))
    for split in (1, 2):
        cfg = {"rows": 16, "block_k": 16, "warps": 4, "split": split}
        raw = gemv_rows(w, normed, torch.zeros(nb, q * v, device=DEVICE), **cfg).view(nb, q, v)
        probs, codes = torch.zeros_like(raw), torch.zeros(nb, q, dtype=torch.long, device=DEVICE)
        sample_codes(raw, temps, bos, block, noise, probs, codes, 0.7, 20, MIN_KEEP)
        for b in range(nb):
            one = rms_norm(h[b], norm, torch.empty_like(h[b]))
            assert torch.equal(one, normed[b])
            r = gemv(w, one, torch.zeros(q * v, device=DEVICE), **cfg).view(q, v)
            assert torch.equal(r, raw[b])
            p, c = torch.zeros_like(r), torch.zeros(q, dtype=torch.long, device=DEVICE)
            sample_codes(r, temps, bos[b], block[b], noise[b], p, c, 0.7, 20, MIN_KEEP)
            assert torch.equal(p, probs[b]) and torch.equal(c, codes[b])


def test_runner_batched_steps_equal_single_steps(tiny_dir):
    """Two streams of different texts, stepped together from different positions (one starts a step
    later), give each step the raw logits and greedy codes of the same stream alone (bfloat16)."""
    s = Synthesizer.load(str(tiny_dir), backend="eager", device=DEVICE, dtype="float32")
    model = s.tts_model.to(torch.bfloat16)
    conds = [s.tokenizers.condition(t, model.config.streaming_text_reserved_len)
             for t in ("Hello there, how are you doing today?", "One.")]
    spk = torch.nn.functional.normalize(torch.randn(model.config.decoder.dim), dim=0).to(DEVICE)
    steps, late = 3, 1
    alone = []
    r1 = fast(GraphTTSRunner(model, use_triton=True))
    for cond in conds:
        r1.trace = []
        r1.start(cond.n)
        r1.prefill(cond.ids[: cond.n + 3], 0, spk)
        codes, _ = r1.generate(None, n_steps=steps, min_new=steps)
        alone.append((codes, torch.stack([raw for raw, _ in r1.trace])))
    r = fast(GraphTTSRunner(model, use_triton=True, rows=2, batch_kernels="rows"))
    for b, cond in enumerate(conds):
        r.start_row(b, cond.n)
        r.prefill_row(b, cond.ids[: cond.n + 3], 0, spk)
    calls = [r.call(0, None, steps, steps), None]
    raws = [[], []]
    for i in range(steps + late):
        if i == late:
            calls[1] = r.call(1, None, steps, steps)
        now = [c for c in calls if c is not None and c.result is None]
        r.step_calls(now)
        for c in now:
            raws[c.row].append(r.raw_b[c.row].clone())
    for b, (codes, raw) in enumerate(alone):
        assert torch.equal(calls[b].result[0], codes)
        assert torch.equal(torch.stack(raws[b]), raw)


def fast(runner: GraphTTSRunner) -> GraphTTSRunner:
    """Fewer, larger programs for the interpreter (one at a time): attention over blocks of 512
    slots, code heads in blocks of 256 rows. Batched and single steps share them."""
    runner.triton.block_s = 512
    runner.heads_cfg["rows"] = 256
    return runner


# The tensor-core step: several K-blocks in every product, o and down split over K (the heads'
# product: test_mma_rows_do_not_depend_on_batch).
MMA_CFG = {"qkv": (16, 32, 4), "o": (16, 16, 2, 4), "gate_up": (16, 32, 4), "down": (16, 32, 2, 4)}


def mma_decoder(dtype, rows: int) -> Decoder:
    """A fused decoder of two heads of 32 (a rotated half head fills a 16-column block) and one KV
    head, whose KV cache of `rows` rows holds the same random values in every dtype."""
    torch.manual_seed(0)
    c = DecoderConfig(dim=64, n_layers=1, n_heads=2, n_kv_heads=1, intermediate=96, rope_theta=10000.0,
                      norm_eps=1e-6, qkv_bias=True, max_positions=256)
    d = Decoder(c)
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.3)
    d.fuse()
    d.setup_cache(MAX, torch.float32, "cpu", rows)
    for layer in d.layers:
        layer.self_attn.kv_cache.k.normal_()
        layer.self_attn.kv_cache.v.normal_()
    d = d.to(DEVICE, dtype)
    d.setup_rope(256, DEVICE)  # (plain attributes: `to` leaves them where they are)
    return d


def rows_of(d: Decoder, rows: list[int]) -> Decoder:
    """A copy of d whose KV cache rows are d's rows `rows`, in that order."""
    one = copy.deepcopy(d)
    for layer, src in zip(one.layers, d.layers):
        layer.self_attn.kv_cache.k = src.self_attn.kv_cache.k[rows].clone()
        layer.self_attn.kv_cache.v = src.self_attn.kv_cache.v[rows].clone()
    return one


def mma_step(d: Decoder, x, pos, vis, many: dict | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One MMADecode step of d's rows -> (residual streams (nb, dim), the K and V caches); with
    `many`, its tiles for every row count."""
    single = TritonDecode(d, None)
    single.block_s = 32  # attention over two cache blocks and splits
    m = MMADecode(single)
    m.cfg = MMA_CFG
    if many is not None:
        m.many, m.many_from = many, 1
    with torch.inference_mode():
        out = m(x, pos, vis).clone()
    assert not m.scratch.count.any()  # split counters back to zero
    return out, [t for layer in d.layers for t in (layer.self_attn.kv_cache.k, layer.self_attn.kv_cache.v)]


def mma_inputs(nb: int, dtype, seed: int):
    """Step rows at their own positions, each with its own visibility (the current slot seen)."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, MAX, (nb,), generator=gen)
    vis = torch.where(torch.rand(nb, MAX, generator=gen) < 0.3, 10**6, torch.randint(0, 40, (nb, MAX), generator=gen))
    vis[torch.arange(nb), pos] = 0
    return torch.randn(nb, 64, generator=gen).to(DEVICE, dtype), pos.to(DEVICE), vis.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mma_step_rows_do_not_depend_on_batch(dtype):
    """Rows of a 17-row step (two blocks of 16) against the same rows, same inputs and cache rows,
    alone and in the middle of 3-row steps with other rows: outputs and cache rows bit for bit."""
    nb = 17
    d = mma_decoder(dtype, nb)
    x, pos, vis = mma_inputs(nb, dtype, 1)
    out, caches = mma_step(rows_of(d, list(range(nb))), x, pos, vis)
    ox, opos, ovis = mma_inputs(2, dtype, 2)  # other rows' inputs
    for b in (6, 16):
        o1, c1 = mma_step(rows_of(d, [b]), x[b : b + 1], pos[b : b + 1], vis[b : b + 1])
        rows = [(b + 3) % nb, b, (b + 5) % nb]
        o3, c3 = mma_step(rows_of(d, rows), torch.stack([ox[0], x[b], ox[1]]), torch.stack([opos[0], pos[b], opos[1]]),
                          torch.stack([ovis[0], vis[b], ovis[1]]))
        assert torch.equal(out[b], o1[0]) and torch.equal(out[b], o3[1]), f"row {b}"
        for c, one, three in zip(caches, c1, c3):
            assert torch.equal(c[b], one[0]) and torch.equal(c[b], three[1]), f"cache row {b}"


# rows and columns a program past MMA_CFG's: `mma_many`'s, and one between
MANY = [{name: tiles for name in ("qkv", "o", "gate_up", "down")} for tiles in ((64, 64, 8), (32, 32, 4))]


@pytest.mark.parametrize("dtype,many", [(torch.bfloat16, MANY[0]), (torch.float32, MANY[1])])
def test_mma_many_tiles_rows_do_not_depend_on_batch(dtype, many):
    """`MMADecode.many`'s tiles (64 or 32 rows and columns a program): a row's outputs and cache
    writes are the same bits in a 17-row step and in a 3-row one with other rows, and the same as
    with the default tiles (on a GPU: the tensor cores' sums in bfloat16, float32 products in
    float32)."""
    nb = 17
    d = mma_decoder(dtype, nb)
    x, pos, vis = mma_inputs(nb, dtype, 1)
    out, caches = mma_step(rows_of(d, list(range(nb))), x, pos, vis, many)
    ox, opos, ovis = mma_inputs(2, dtype, 2)
    b, rows = 6, [9, 6, 11]
    o3, c3 = mma_step(rows_of(d, rows), torch.stack([ox[0], x[b], ox[1]]), torch.stack([opos[0], pos[b], opos[1]]),
                      torch.stack([ovis[0], vis[b], ovis[1]]), many)
    assert torch.equal(out[b], o3[1])
    for c, three in zip(caches, c3):
        assert torch.equal(c[b], three[1])
    default, _ = mma_step(rows_of(d, list(range(nb))), x, pos, vis)
    assert torch.equal(out, default)


def test_mma_step_close_to_eager():
    """Five rows against the eager decoder's batched step (per-row positions and masks): float32 to
    its summation order, bfloat16 (output and each row's written K/V) within a few times the eager
    bfloat16 step's own error."""
    nb = 5
    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        d = mma_decoder(dtype, nb)
        e = copy.deepcopy(d)
        x, pos, vis = mma_inputs(nb, torch.float32, 3)
        out, caches = mma_step(d, x.to(dtype), pos, vis)
        slots = torch.arange(MAX, device=DEVICE)
        mask = ((vis <= pos[:, None]) & (slots <= pos[:, None]))[:, None, None]  # (nb, 1, 1, MAX)
        with torch.inference_mode():
            ref = e(x[:, None].to(dtype), pos[:, None], mask, MAX, rows=slice(0, nb))[:, 0]
            res[dtype] = (d.norm(out).float(), ref.float(), [t.float() for t in caches],
                          [t.float() for layer in e.layers for t in (layer.self_attn.kv_cache.k, layer.self_attn.kv_cache.v)])
    out, ref, caches, ref_caches = res[torch.float32]
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    for c, r in zip(caches, ref_caches):
        torch.testing.assert_close(c, r, rtol=1e-5, atol=1e-5)
    out16, eager16, caches16, eager_caches16 = res[torch.bfloat16]
    written = (torch.arange(nb, device=DEVICE), slice(None), pos)  # each row's slot of this step
    steps = [(c[written], e[written], r[written]) for c, e, r in zip(caches16, eager_caches16, ref_caches)]
    for mine, eager, f32 in [(out16, eager16, ref), *steps]:
        # (on the written slots the tensor-core step's bfloat16 error is ~4x the eager step's: 0.041
        # against 0.011 for K here; the cache's other slots hold the same values in both)
        assert (mine - f32).abs().max() <= max(5 * (eager - f32).abs().max(), 1e-2 * f32.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mma_rows_do_not_depend_on_batch(dtype):
    """`mma_rows` (the code heads; split over K too): rows of 17 as alone and among 3, close to torch."""
    gen = torch.Generator().manual_seed(4)
    w = Weight(torch.randn(40, 64, generator=gen).to(DEVICE, dtype))
    y = torch.randn(17, 64, generator=gen).to(DEVICE, dtype)
    other = torch.randn(2, 64, generator=gen).to(DEVICE, dtype)
    for split in (1, 2):
        cfg = {"block_n": 16, "block_k": 16, "split": split}  # 4 K-blocks, 3 column blocks
        out = mma_rows(w, y, torch.zeros(17, 40, device=DEVICE), **cfg)
        ref = (y.double() @ w.w.double().T).to(dtype).float()
        torch.testing.assert_close(out, ref, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-4)
        for b in (0, 16):
            one = mma_rows(w, y[b : b + 1], torch.zeros(1, 40, device=DEVICE), **cfg)
            three = mma_rows(w, torch.stack([other[0], y[b], other[1]]), torch.zeros(3, 40, device=DEVICE), **cfg)
            assert torch.equal(out[b], one[0]) and torch.equal(out[b], three[1])


@pytest.mark.parametrize("dtype,heads,hkv,masked", [
    (torch.float32, 6, 2, True),
    (torch.bfloat16, 4, 1, False),
])
def test_grouped_attention_on_the_tensor_cores(dtype, heads, hkv, masked):
    """`rows_attend_dot` (the query heads of a KV head as the M side of tensor-core products): close
    to `rows_attend` (a program a head and split; float32 to rounding, bfloat16 to its P rounded to
    bfloat16), rows at positions in their first block, across several splits and past SPLITS blocks,
    masked or causal; a row's output the same whatever the number of rows; the split counters left
    at zero."""
    from minicpm_cli.backends.kernels.attention import attend_mode, attend_rows

    torch.manual_seed(0)
    rows, slots, d, block_s, splits = 6, 160, 16, 16, 4  # 10 blocks: splits 0 and 1 take a later block
    k = torch.randn(rows, hkv, slots, d, device=DEVICE).to(dtype)
    v = torch.randn(rows, hkv, slots, d, device=DEVICE).to(dtype)
    q = torch.randn(rows, heads * d, device=DEVICE).to(dtype)
    pos = torch.tensor([3, 159, 40, 80, 16, 142], device=DEVICE)
    vis = None
    if masked:  # some older slots hidden; a row's own slot seen, as in a step
        vis = torch.randint(0, 120, (rows, slots), device=DEVICE)
        vis[torch.arange(rows), pos] = 0
    part = torch.zeros(rows * heads * splits * (d + 2), device=DEVICE)
    count = torch.zeros(rows * heads, dtype=torch.int32, device=DEVICE)

    def attend(nb: int, mode: str) -> torch.Tensor:
        out = torch.zeros_like(q)
        attend_rows(q, k, v, vis, pos, out, part, count, nb=nb, heads=heads, splits=splits, block_s=block_s,
                    mode=mode)
        return out[:nb]

    head, dot = attend(rows, "head"), attend(rows, "dot")
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dot.float(), head.float(), **tol)
    assert torch.equal(attend(2, "dot"), dot[:2]) and torch.equal(attend(1, "dot"), dot[:1])
    assert not torch.equal(dot[0], dot[1]) and bool((count == 0).all())
    assert attend_mode(heads // hkv) == "dot" and attend_mode(1) == "head"
    with pytest.raises(ValueError, match="mode"):
        attend(rows, "whole")


def test_mma_many_tiles_only_where_measured():
    """The 64-row tiles are taken on sm_90 in bfloat16 only: float32's tiles would pass a block's
    shared memory, and other GPUs' figures and bits were not measured."""
    from minicpm_cli.backends.kernels.mma import mma_many

    tiles, start = mma_many((9, 0))
    assert start == 96 and tiles["gate_up"] == (64, 64, 8)
    for cc, dtype in (((9, 0), torch.float32), ((8, 0), torch.bfloat16), ((10, 0), torch.bfloat16),
                      (None, torch.bfloat16)):
        assert mma_many(cc, dtype) == ({}, None), (cc, dtype)
