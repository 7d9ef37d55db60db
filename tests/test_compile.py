"""`--backend compile` computes what `eager` computes (greedy, float32, wherever torch.compile runs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minicpm_cli.engine.llm import LLMSampling, reply_pieces
from minicpm_cli.engine.pipeline import Synthesizer
from minicpm_cli.engine.sampling import Sampling


@pytest.fixture(scope="module")
def compiled(tiny_dir):
    return Synthesizer.load(str(tiny_dir), backend="compile", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def eager(tiny_dir):
    return Synthesizer.load(str(tiny_dir), backend="eager", device="cpu", dtype="float32")


def test_projections_are_fused(compiled):
    layer = compiled.llm.model.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and not hasattr(layer.self_attn, "q_proj")
    assert compiled.tts_model.model.layers[0].mlp.gate_up_proj is not None


@pytest.mark.parametrize("tag", ["short", "punct", "digits"])
def test_read_codes_equal_eager_and_goldens(compiled, eager, goldens, manifest, tag):
    text = next(e for e in manifest["read"] if e["tag"] == tag)["text"]
    a = compiled.say(text, Sampling(greedy=True))
    b = eager.say(text, Sampling(greedy=True))
    assert torch.equal(a.codes, b.codes)
    np.testing.assert_array_equal(a.codes.numpy(), goldens[f"read_{tag}_codes"])
    np.testing.assert_allclose(a.audio, b.audio, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tag", ["fine", "long"])
def test_reply_tokens_and_codes_equal_eager(compiled, eager, goldens, manifest, tag):
    e = next(x for x in manifest["reply"] + manifest["long_reply"] if x["tag"] == tag)
    tokens = [[i for p in reply_pieces(s.llm, s.tokenizers, e["user_text"], LLMSampling(), None,
                                        e["llm_max_new_tokens"]) for i in p.ids] for s in (compiled, eager)]
    assert tokens[0] == tokens[1] == goldens[f"reply_{tag}_llm_new_tokens"].tolist()
    codes = [torch.cat([c.codes for c in s.reply(e["user_text"], Sampling(greedy=True),
                                                   max_tokens=e["llm_max_new_tokens"])]) for s in (compiled, eager)]
    assert torch.equal(codes[0], codes[1])
    np.testing.assert_array_equal(codes[0].numpy(), goldens[f"reply_{tag}_codes"])


def test_seeded_sampling_matches_eager(compiled, eager):
    a = compiled.say("Good morning! Could you tell me the way?", Sampling(seed=5)).codes
    b = eager.say("Good morning! Could you tell me the way?", Sampling(seed=5)).codes
    assert torch.equal(a, b)


def test_warm_ups_cover_every_batch_bucket():
    """`batch_sizes` lists the graphs' row counts that batches of 2..rows streams reach, so that the
    warm-ups capture them all: with a capacity that is not a power of two, the capacity itself."""
    from minicpm_cli.backends.compile import batch_sizes

    assert batch_sizes(16, 16) == [2, 4, 8, 16]
    assert batch_sizes(6, 6) == [2, 4, 6]
    assert batch_sizes(6, 12) == [2, 4, 8]
    assert batch_sizes(1, 1) == []
