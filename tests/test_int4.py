"""`--backend int4`: the GPTQ format read by our own code, checked against hand-computed words and
against the same model run with the dequantized weights."""

from __future__ import annotations

import json

import pytest
import torch

from minicpm_cli.backends.gptq import Int4Linear, dequantize, pack_rows, quantize, unpack, unpack_rows
from minicpm_cli.engine.pipeline import Synthesizer
from minicpm_cli.engine.sampling import Sampling
from minicpm_cli.backends.gptq import write_gptq_checkpoint


def _word(nibbles):
    """The int32 (signed) whose 4-bit fields 0..7 hold `nibbles`, computed with plain ints."""
    w = sum(v << (4 * k) for k, v in enumerate(nibbles))
    return w - 2**32 if w >= 2**31 else w


def test_packing_against_hand_computed_words():
    values = torch.tensor([[(i * 3 + o * 5) % 16 for o in range(3)] for i in range(16)])  # (in=16, out=3)
    expected = [[_word([(i * 3 + o * 5) % 16 for i in range(8 * r, 8 * r + 8)]) for o in range(3)] for r in range(2)]
    assert pack_rows(values).tolist() == expected
    assert _word(range(1, 9)) == -2023406815  # 0x87654321: value k in bits 4k..4k+3
    assert unpack_rows(torch.tensor([[-2023406815]], dtype=torch.int32)).flatten().tolist() == list(range(1, 9))


def test_zero_points_are_stored_minus_one():
    # sym 4-bit: true zero 8, stored 7 in every nibble -> 0x77777777
    w = torch.randn(8, 32)
    t = quantize(w, -1, sym=True)
    assert t["qzeros"].tolist() == [[0x77777777]]
    q, zeros, scales, g = unpack(**t)
    assert zeros.unique().tolist() == [8]
    # the dequantized weight is scales * (q - 8), row by row
    expected = (scales.float()[g] * (q.float() - 8)).T
    assert torch.equal(dequantize(**t), expected)


@pytest.mark.parametrize("group_size,desc_act,sym", [(-1, False, True), (32, True, True), (64, False, False)])
def test_int4_linear_matches_dequantized(group_size, desc_act, sym):
    torch.manual_seed(0)
    w = torch.randn(48, 128) * 0.05
    g_idx = None
    if desc_act:
        g_idx = (torch.arange(128) // group_size)[torch.randperm(128)]
    t = quantize(w, group_size, sym=sym, g_idx=g_idx)
    lin = Int4Linear(**t, bias=torch.randn(48), dtype=torch.float32, device="cpu")
    x = torch.randn(5, 128)
    ref = x @ dequantize(**t).T + lin.bias
    torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5)
    assert (lin.perm is not None) == desc_act


@pytest.fixture(scope="module")
def checkpoints(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    out = {}
    for tag, gs, desc in (("channel", -1, False), ("grouped", 32, True)):
        int4 = write_gptq_checkpoint(tiny_dir, root / f"{tag}-int4", group_size=gs, desc_act=desc,
                                     dequantized_to=root / f"{tag}-deq")
        out[tag] = (int4, root / f"{tag}-deq")
    return out


def test_layout_is_the_official_int4_one(checkpoints):
    from safetensors import safe_open

    int4, _ = checkpoints["channel"]
    cfg = json.loads((int4 / "quantize_config.json").read_text())
    assert (cfg["bits"], cfg["group_size"], cfg["desc_act"], cfg["sym"], cfg["checkpoint_format"]) == (4, -1, False, True, "gptq")
    with safe_open(int4 / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        p = "llm.model.layers.0.mlp.down_proj."
        assert {p + k for k in ("qweight", "qzeros", "scales", "g_idx")} <= keys and p + "weight" not in keys
        assert f.get_slice(p + "qweight").get_shape() == [128 // 8, 64]  # (in/8, out)
        assert f.get_slice(p + "qzeros").get_shape() == [1, 64 // 8]
        assert "llm.model.layers.0.self_attn.q_proj.bias" in keys and "llm.lm_head.weight" in keys
        assert "tts.emb_text.weight" in keys


@pytest.mark.parametrize("tag", ["channel", "grouped"])
def test_int4_path_matches_dequantized_model(checkpoints, tag):
    int4_dir, deq_dir = checkpoints[tag]
    a = Synthesizer.load(str(int4_dir), backend="int4", device="cpu", dtype="float32")
    b = Synthesizer.load(str(deq_dir), backend="eager", device="cpu", dtype="float32")
    ids = a.tokenizers.encode_llm("<|im_start|>user\nPlease read the text below.\nHello world.<|im_end|>\n")
    for s in (a, b):
        s.llm.reset()
    (la, ha), (lb, hb) = a.llm.forward(ids), b.llm.forward(ids)
    for x, y in ((la, lb), (ha, hb)):
        assert (x - y).abs().max() <= 1e-4 * y.abs().max()
    for text in ("Hello world.", "Call me at 555 0199 before 6 pm."):
        ca = a.say(text, Sampling(greedy=True)).codes
        cb = b.say(text, Sampling(greedy=True)).codes
        assert torch.equal(ca, cb)
    q4 = a.llm.model.model.layers[0].mlp.down_proj
    f32 = b.llm.model.model.layers[0].mlp.down_proj.weight
    assert q4.weight_bytes < f32.numel() * 4 / 6  # 4 bits + scales vs 32 bits


def test_random_weights_are_the_same_whatever_was_drawn_before():
    """int4 with random weights draws its 4-bit words from generators seeded by the checkpoint's
    seed and each tensor's name: torch's global generator (which other code draws from) changes
    nothing, the seed does. (They came from the global one: each process spoke otherwise.)"""
    from minicpm_cli.backends.int4 import build
    from minicpm_cli.engine.synthetic import RandomCheckpoint, SyntheticSpec

    def words(seed: int, global_seed: int) -> list[torch.Tensor]:
        ckpt = RandomCheckpoint(SyntheticSpec.tiny(), seed=seed)
        with torch.random.fork_rng(devices=[]):  # (the global generator as it was for later tests)
            torch.manual_seed(global_seed)
            torch.rand(global_seed + 1)
            model = build(ckpt, ckpt.config, device="cpu", dtype=torch.float32, triton=True)
        return [b for name, b in model.named_buffers() if name.endswith("packed")]

    first, again = words(0, 1), words(0, 2)
    assert first and len(first) == len(again) and all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], words(1, 1)[0])
