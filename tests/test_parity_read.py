"""Parity of the read-aloud path with the reference's goldens (float32, CPU, greedy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minicpm_cli.engine.pipeline import Synthesizer
from minicpm_cli.engine.sampling import Sampling
from minicpm_cli.engine.text import read_prompt

TAGS = ["short", "punct", "digits"]


@pytest.fixture(scope="module")
def synth(tiny_dir):
    torch.manual_seed(0)
    return Synthesizer.load(str(tiny_dir), device="cpu", dtype="float32")


def _read(manifest, tag):
    return next(e for e in manifest["read"] if e["tag"] == tag)


@pytest.mark.parametrize("tag", TAGS)
def test_prompt_and_condition_ids(synth, goldens, manifest, tag):
    text = _read(manifest, tag)["text"]
    ids = synth.tokenizers.encode_llm(read_prompt(text))
    assert ids == goldens[f"read_{tag}_llm_input_ids"].tolist()
    start, end = goldens[f"read_{tag}_spk_bounds"][0]
    assert ids[start:end] == [synth.tokenizers.spk_id]
    cond = synth.tokenizers.condition(text, 300)
    assert cond.ids == goldens[f"read_{tag}_tts_input_ids"].tolist()
    assert cond.n == _read(manifest, tag)["tts_token_len"]


@pytest.mark.parametrize("tag", TAGS)
def test_llm_hidden_and_speaker_vector(synth, goldens, manifest, tag):
    ids = synth.tokenizers.encode_llm(read_prompt(_read(manifest, tag)["text"]))
    synth.llm.reset()
    _, hidden = synth.llm.forward(ids)
    np.testing.assert_allclose(hidden.numpy(), goldens[f"read_{tag}_llm_last_hidden"], atol=1e-4, rtol=0)
    spk = synth.speaker(ids)
    np.testing.assert_allclose(spk.numpy(), goldens[f"read_{tag}_spk_proj"][0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("tag", TAGS)
def test_codes_logits_and_waveform(synth, goldens, manifest, tag):
    synth.tts.trace = []
    try:
        utt = synth.say(_read(manifest, tag)["text"], Sampling(greedy=True))
        trace = synth.tts.trace
    finally:
        synth.tts.trace = None
    raw = torch.stack([t[0] for t in trace[:3]]).numpy()
    probs = torch.stack([t[1] for t in trace[:3]]).numpy()
    np.testing.assert_allclose(raw, goldens[f"read_{tag}_tts_logits_first3"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(probs, goldens[f"read_{tag}_tts_probs_first3"], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(utt.codes.numpy(), goldens[f"read_{tag}_codes"])
    assert utt.sample_rate == 24000
    np.testing.assert_allclose(utt.audio, goldens[f"read_{tag}_wav"], atol=1e-5, rtol=0)


def test_sampling_is_seeded(synth):
    a = synth.say("Hello world.", Sampling(seed=7)).codes
    b = synth.say("Hello world.", Sampling(seed=7)).codes
    c = synth.say("Hello world.", Sampling(seed=8)).codes
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
