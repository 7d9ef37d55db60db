"""The Triton decode kernels (backends/kernels/) against the eager decoder, and the TTS step built
on them against the eager runner. Without a GPU they run in Triton's interpreter (conftest)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import llm_eager_and_kernel_runs, tts_eager_and_kernel_runs

pytest.importorskip("triton")

from minicpm_cli.backends.kernels.decode import TritonDecode, kernels_scratch
from minicpm_cli.models.transformer import Decoder, DecoderConfig
from minicpm_cli.engine.pipeline import Synthesizer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX = 96


def decoder(gqa: bool, bias: bool) -> Decoder:
    torch.manual_seed(0)
    c = DecoderConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2 if gqa else 4, intermediate=96,
                      rope_theta=10000.0, norm_eps=1e-6, qkv_bias=bias, max_positions=256)
    d = Decoder(c)
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return d


def prepared(base: Decoder, dtype, prefix: torch.Tensor) -> Decoder:
    """A fused copy with its cache holding `prefix` (causal prefill by the eager code)."""
    d = copy.deepcopy(base).to(DEVICE, dtype)
    d.fuse()
    d.setup_cache(MAX, dtype, DEVICE)
    d.setup_rope(256, DEVICE)
    n = prefix.shape[1]
    slots = torch.arange(n, device=DEVICE)
    with torch.inference_mode():
        d(prefix.to(DEVICE, dtype), slots, (slots[None, :] <= slots[:, None])[None, None], n)
    return d


def step_both(base, dtype, visible_from, block_s=64, split=False):
    """One token at position 20 through the eager decoder and through TritonDecode (attention split
    into blocks of `block_s` slots; with `split`, the projections in several K-blocks, o and down
    split over K too)."""
    n = 20
    prefix, x = torch.randn(1, n, 64), torch.randn(64)
    pos = torch.tensor([n], device=DEVICE)
    slots = torch.arange(n + 1, device=DEVICE)
    seen = (visible_from[: n + 1] if visible_from is not None else slots) <= n
    with torch.inference_mode():
        e = prepared(base, dtype, prefix)
        ref = e(x[None, None].to(DEVICE, dtype), pos, seen[None, None, None], n + 1)[0, 0]
        t = prepared(base, dtype, prefix)
        td = TritonDecode(t, visible_from)
        td.block_s = block_s
        if split:  # several K-blocks a program, o and down split over K:
            # qkv 4 blocks of 16 inputs, gate/up 2 of 32, o 4 of 16 over 2 programs, down 6 of 16 over 2
            td.cfg = {"qkv": (8, 16, 4, 1), "o": (8, 16, 4, 1, 2), "gate_up": (8, 32, 4, 1), "down": (8, 16, 4, 1, 2)}
            td.scratch = kernels_scratch(td.cfg, td.weights[0][1], td.weights[0][3], DEVICE)
        out = t.norm(td(x.to(DEVICE, dtype), pos))
        assert not td.count.any()  # the split counters are back to zero for the next step
        assert not td.scratch.count.any()
    return e, t, ref.float(), out.float()


@pytest.mark.parametrize("gqa,bias,masked,block_s,split", [(True, True, False, 64, False), (False, False, True, 16, True),
                                                          (True, False, True, 8, False)])
def test_decode_step_matches_eager_float32(gqa, bias, masked, block_s, split):
    slots = torch.arange(MAX, device=DEVICE)
    # with a mask: every third slot never seen, the others from their own position (as TTS audio slots)
    vis = torch.where(slots % 3 == 0, 10**6, slots) if masked else None
    e, t, ref, out = step_both(decoder(gqa, bias), torch.float32, vis, block_s, split)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    for le, lt in zip(e.layers, t.layers):  # the new K/V rows landed in the cache slot of position 20
        torch.testing.assert_close(lt.self_attn.kv_cache.k, le.self_attn.kv_cache.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lt.self_attn.kv_cache.v, le.self_attn.kv_cache.v, rtol=1e-5, atol=1e-5)


def test_decode_step_bfloat16_within_eager_rounding():
    base = decoder(True, True)
    _, _, f32, _ = step_both(base, torch.float32, None)
    _, _, eager_bf16, triton_bf16 = step_both(base, torch.bfloat16, None)
    scale = f32.abs().max()
    # the kernels round where the eager code rounds: their error is of the eager bf16 error's size
    assert (triton_bf16 - f32).abs().max() <= max(3 * (eager_bf16 - f32).abs().max(), 1e-2 * scale)


def test_tts_steps_on_kernels_match_eager_runner(tiny_dir):
    """Greedy frames and step logits of the kernel-backed runner equal the eager runner's (float32)."""

    s = Synthesizer.load(str(tiny_dir), backend="eager", device=DEVICE, dtype="float32")
    runs = tts_eager_and_kernel_runs(s, "Hello there, how are you doing today?", DEVICE)
    (codes_e, raw_e), (codes_t, raw_t) = runs
    assert len(codes_e) == 4 and torch.equal(codes_e, codes_t)
    assert (raw_t - raw_e).abs().max() <= 1e-4 * raw_e.abs().max()


def test_llm_decode_on_kernels_matches_eager(tiny_dir):
    """Prompt, then greedy tokens decoded on the kernels: the same tokens and logits as eager."""
    runs = llm_eager_and_kernel_runs(tiny_dir, DEVICE, "Hello world, how are you?", steps=6)
    (le, he), (lt, ht) = runs
    assert torch.equal(le.argmax(-1), lt.argmax(-1))
    assert (lt - le).abs().max() <= 1e-4 * le.abs().max()
    assert (ht - he).abs().max() <= 1e-4 * he.abs().max()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embed_codes_kernel_matches_torch(tiny_dir, dtype):
    """A step's input embeddings in one launch: BOS rows the BOS embedding, the others the sum of
    their codes' embeddings, each row bit for bit the eager `where(bos, bos_embed, embed_codes)`."""
    from minicpm_cli.backends.kernels.embed import embed_codes
    from minicpm_cli.engine.tts import TTSRunner

    s = Synthesizer.load(str(tiny_dir), backend="eager", device=DEVICE, dtype=dtype)
    r = TTSRunner(s.tts_model, rows=5)
    c = r.config
    torch.manual_seed(2)
    last = torch.randint(0, c.num_audio_tokens, (5, c.num_vq), device=DEVICE)
    last[3] = c.num_audio_tokens - 1  # the last row of every table
    bos = torch.tensor([[False], [True], [False], [False], [True]], device=DEVICE)
    tables = torch.stack([e.weight.detach() for e in s.tts_model.emb_code])
    out = torch.full((5, c.decoder.dim), float("nan"), dtype=r.dtype, device=DEVICE)
    embed_codes(last, tables, bos, r.bos_embed, out)
    ref = r._embed(bos, last)
    if DEVICE == "cpu" and dtype == "bfloat16":  # (the interpreter rounds to bfloat16 by truncation)
        torch.testing.assert_close(out, ref, rtol=2**-7, atol=0)
        assert torch.equal(out[bos[:, 0]], ref[bos[:, 0]])
    else:
        assert torch.equal(out, ref)
    one = torch.zeros_like(out[:1])
    embed_codes(last[2:3], tables, bos[2:3], r.bos_embed, one)  # a row alone: the same
    assert torch.equal(one[0], out[2])


@pytest.mark.parametrize("bos,block_eos,sampled", [(False, False, False), (False, True, True), (True, False, True)])
def test_code_sampling_kernel_matches_torch(tiny_dir, bos, block_eos, sampled):
    """Temperature, top-p, top-k, EOS block, softmax and the draw: the same probabilities and codes."""
    from minicpm_cli.backends.kernels.sampling import sample_codes
    from minicpm_cli.engine.tts import MIN_KEEP, TTSRunner

    s = Synthesizer.load(str(tiny_dir), backend="eager", device=DEVICE, dtype="float32")
    r = TTSRunner(s.tts_model)
    c = r.config
    torch.manual_seed(1)
    for trial in range(3):
        raw = torch.randn(c.num_vq, c.num_audio_tokens, device=DEVICE) * (0.5 + trial)
        r.bos_t.fill_(bos)
        r.block_eos_t.fill_(block_eos)
        r.noise_t.exponential_()
        ref = r._choose(raw, sampled)
        ref_codes = r.code_t.clone()
        probs, codes = torch.zeros_like(ref), torch.zeros_like(ref_codes)
        sample_codes(raw, r.temps, r.bos_t, r.block_eos_t, r.noise_t if sampled else None, probs, codes,
                     c.top_p, c.top_k, MIN_KEEP)
        assert torch.equal(codes, ref_codes)
        assert torch.equal(probs > 0, ref > 0)  # the same tokens survive the warpers
        torch.testing.assert_close(probs, ref, rtol=1e-5, atol=1e-7)
