"""The speech path on CUDA (skipped without a GPU): float32 parity on the tiny checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minicpm_cli.engine.pipeline import Synthesizer
from minicpm_cli.engine.sampling import Sampling

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def synth(tiny_dir):
    return Synthesizer.load(str(tiny_dir), device="cuda", dtype="float32")


@pytest.mark.parametrize("tag", ["short", "punct", "digits"])
def test_read_parity_on_cuda(synth, assert_read_golden, tag):
    assert_read_golden(synth, tag, atol=1e-4)


def test_reply_parity_on_cuda(synth, goldens, manifest):
    e = next(e for e in manifest["reply"] if e["tag"] == "fine")
    chunks = list(synth.reply(e["user_text"], Sampling(greedy=True), max_tokens=24))
    np.testing.assert_array_equal(torch.cat([c.codes for c in chunks]).numpy(), goldens["reply_fine_codes"])
    np.testing.assert_allclose(np.concatenate([c.samples for c in chunks]), goldens["reply_fine_wav"], atol=1e-4, rtol=0)


def test_sampling_runs_in_bf16(tiny_dir):
    s = Synthesizer.load(str(tiny_dir), device="cuda", dtype="bfloat16")
    a = s.say("Hello world.", Sampling(seed=3))
    b = s.say("Hello world.", Sampling(seed=3))
    assert torch.equal(a.codes, b.codes) and len(a.audio) == 512 * len(a.codes)


def test_int4_on_cuda_matches_dequantized(tiny_dir, tmp_path):
    from minicpm_cli.backends.gptq import write_gptq_checkpoint

    write_gptq_checkpoint(tiny_dir, tmp_path / "int4", dequantized_to=tmp_path / "deq")
    a = Synthesizer.load(str(tmp_path / "int4"), backend="int4", device="cuda", dtype="bfloat16")
    b = Synthesizer.load(str(tmp_path / "deq"), backend="eager", device="cuda", dtype="bfloat16")
    ids = a.tokenizers.encode_llm("<|im_start|>user\nHello world.<|im_end|>\n")
    for s in (a, b):
        s.llm.reset()
    (la, ha), (lb, hb) = a.llm.forward(ids), b.llm.forward(ids)
    assert (ha.float() - hb.float()).abs().max() <= 0.05 * hb.float().abs().max()  # bf16 on both sides
    assert (la - lb).abs().max() <= 0.05 * lb.abs().max()
    assert len(a.say("Hello world.", Sampling(seed=1)).codes) > 0


@pytest.fixture(scope="module")
def voice_synth(voice_dir):
    return Synthesizer.load(str(voice_dir), device="cuda", dtype="float32")


def test_voice_parity_on_cuda(voice_synth, goldens_voice, manifest_voice):
    """A voice's audio embeddings enter a prefill outside the CUDA graphs; the rest replays them."""
    from minicpm_cli.voices.reference import Voice

    voice = Voice(goldens_voice["ref_a_samples"])
    for e in manifest_voice["voice_read"]:
        utt = voice_synth.say(e["text"], Sampling(greedy=True), voice=voice)
        np.testing.assert_array_equal(utt.codes.numpy(), goldens_voice[f"vread_{e['tag']}_codes"])
        np.testing.assert_allclose(utt.audio, goldens_voice[f"vread_{e['tag']}_wav"], atol=1e-4, rtol=0)
    e = manifest_voice["voice_reply"][0]
    chunks = list(voice_synth.reply(e["user_text"], Sampling(greedy=True), max_tokens=24, voice=voice))
    np.testing.assert_array_equal(torch.cat([c.codes for c in chunks]).numpy(), goldens_voice["vreply_a_name_codes"])
    np.testing.assert_allclose(np.concatenate([c.samples for c in chunks]), goldens_voice["vreply_a_name_wav"],
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", ["compile", "int4"])
def test_voice_runs_in_bf16(voice_dir, goldens_voice, backend):
    from minicpm_cli.voices.reference import Voice

    s = Synthesizer.load(str(voice_dir), backend=backend, device="cuda", dtype="bfloat16")
    voice = Voice(goldens_voice["ref_a_samples"])
    a = s.say("Hello world.", Sampling(seed=3), voice=voice)
    b = s.say("Hello world.", Sampling(seed=3), voice=voice)
    assert torch.equal(a.codes, b.codes) and len(a.audio) == 512 * len(a.codes)
    assert s.voices.model.apm.conv1.weight.dtype == torch.bfloat16
    assert len(list(s.reply("Hi.", Sampling(seed=3), max_tokens=6, voice=voice))) > 0
