"""The batched Triton decode step (backends/kernels/batch.py) against the single-stream one: each
row of a batch, at its own position and with its own visibility, gives bit for bit what
`TritonDecode` gives it alone (float32 and bfloat16), and so do the final norm, the code heads and
the choice of codes; the TTS runner's batched steps equal its single steps. Without a GPU the kernels
run in Triton's interpreter (conftest)."""

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
from minicpm_cli.backends.kernels.norm import rms_norm
from minicpm_cli.backends.kernels.sampling import sample_codes
from minicpm_cli.models.transformer import Decoder, DecoderConfig
from minicpm_cli.pipeline import Synthesizer
from minicpm_cli.tts import MIN_KEEP

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
    pos = torch.tensor([20, 5, 45, 33], device=DEVICE)  # rows at their own positions, in different cache blocks
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
    r = fast(GraphTTSRunner(model, use_triton=True, rows=2))
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
