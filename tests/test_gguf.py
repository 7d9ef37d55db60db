"""`--backend gguf`: llama.cpp (CPU build in CI) runs the LLM from GGUF files written from the tiny
fixture; it must agree with the eager backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("llama_cpp", reason="the gguf extra (llama-cpp-python) is not installed")

from minicpm_cli.engine import gguf_export  # noqa: E402
from minicpm_cli.engine.checkpoint import Checkpoint, read_config  # noqa: E402
from minicpm_cli.engine.pipeline import Synthesizer  # noqa: E402
from minicpm_cli.engine.sampling import Sampling  # noqa: E402
from minicpm_cli.engine.text import read_prompt  # noqa: E402

from conftest import pythonpath  # noqa: E402


@pytest.fixture(scope="module")
def ggufs(tiny_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    f32 = gguf_export.from_checkpoint(Checkpoint(tiny_dir), read_config(tiny_dir), tiny_dir / "tokenizer.json",
                                      d / "tiny-f32.gguf")
    f16 = gguf_export.from_checkpoint(Checkpoint(tiny_dir), read_config(tiny_dir), tiny_dir / "tokenizer.json",
                                      d / "tiny-f16.gguf", ftype="F16")
    return {"F32": f32, "F16": f16, "Q8_0": gguf_export.quantize(f32, d / "tiny-q8_0.gguf", "Q8_0")}


@pytest.fixture(scope="module")
def eager(tiny_dir):
    return Synthesizer.load(str(tiny_dir), backend="eager", device="cpu", dtype="float32")


def _synth(tiny_dir, path):
    return Synthesizer.load(str(tiny_dir), backend="gguf", gguf=str(path), device="cpu", dtype="float32")


def test_f16_stores_matrices_in_half(ggufs):
    import gguf

    types = {t.name: t.tensor_type for t in gguf.GGUFReader(ggufs["F16"]).tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.0.attn_q.bias"] == types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32


def test_gguf_tensor_names():
    assert gguf_export.gguf_name("model.layers.3.mlp.up_proj.weight") == "blk.3.ffn_up.weight"
    assert gguf_export.gguf_name("model.layers.0.self_attn.q_proj.bias") == "blk.0.attn_q.bias"
    assert gguf_export.gguf_name("lm_head.weight") == "output.weight"


@pytest.mark.parametrize("ftype,tol", [("F32", 1e-4), ("F16", 2e-3), ("Q8_0", 2e-2)])
def test_speaker_vector_matches_eager(tiny_dir, ggufs, eager, goldens, manifest, ftype, tol):
    s = _synth(tiny_dir, ggufs[ftype])
    for e in manifest["read"]:
        ids = s.tokenizers.encode_llm(read_prompt(e["text"]))
        pos = ids.index(s.tokenizers.spk_id)
        s.llm.reset()
        eager.llm.reset()
        h = s.llm.forward(ids)[1][pos]
        ref = eager.llm.forward(ids)[1][pos]
        assert (h - ref).norm() <= tol * ref.norm()
        spk, spk_ref = s.speaker(ids), eager.speaker(ids)
        assert (spk - spk_ref).norm() <= tol * spk_ref.norm()
        if ftype == "F32":
            np.testing.assert_allclose(spk.numpy(), goldens[f"read_{e['tag']}_spk_proj"][0], atol=1e-4)


def test_f32_read_codes_and_reply_tokens_equal_eager(tiny_dir, ggufs, eager, goldens, manifest):
    from minicpm_cli.engine.llm import LLMSampling, reply_pieces

    s = _synth(tiny_dir, ggufs["F32"])
    for e in manifest["read"]:
        np.testing.assert_array_equal(s.say(e["text"], Sampling(greedy=True)).codes.numpy(),
                                      goldens[f"read_{e['tag']}_codes"])
    for e in manifest["reply"] + manifest["long_reply"]:
        tokens = [i for p in reply_pieces(s.llm, s.tokenizers, e["user_text"], LLMSampling(), None,
                                          e["llm_max_new_tokens"]) for i in p.ids]
        gold = goldens[f"reply_{e['tag']}_llm_new_tokens"].tolist()
        assert tokens[: len(gold)] == gold
    e = manifest["reply"][1]
    codes = torch.cat([c.codes for c in s.reply(e["user_text"], Sampling(greedy=True), max_tokens=24)])
    np.testing.assert_array_equal(codes.numpy(), goldens[f"reply_{e['tag']}_codes"])


def test_gguf_command_line(tiny_dir, ggufs, goldens, tmp_path):
    import os
    import subprocess
    import sys

    import soundfile as sf

    env = {**os.environ, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "x.wav"
    p = subprocess.run([sys.executable, "-m", "minicpm_cli", "say", "Hello world.", "--model", str(tiny_dir),
                        "--backend", "gguf", "--gguf", str(ggufs["F32"]), "--greedy", "--device", "cpu",
                        "--dtype", "float32", "--pcm", "f32", "-o", str(out)], capture_output=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr.decode()
    np.testing.assert_allclose(sf.read(out, dtype="float32")[0], goldens["read_short_wav"], atol=1e-4)
    bad = subprocess.run([sys.executable, "-m", "minicpm_cli", "say", "Hi.", "--model", str(tiny_dir), "--backend",
                          "gguf", "--gguf", str(tmp_path / "missing.gguf"), "--device", "cpu", "-o", str(out)],
                         capture_output=True, env=env, timeout=300)
    assert bad.returncode == 1 and b"missing.gguf" in bad.stderr and b"Traceback" not in bad.stderr


@pytest.mark.gpu
def test_f32_on_cuda_read_codes_and_speaker(tiny_dir, ggufs, eager, goldens, manifest):
    """llama.cpp on the GPU (the CUDA build) feeding the TTS on the GPU: the greedy read codes."""
    s = Synthesizer.load(str(tiny_dir), backend="gguf", gguf=str(ggufs["F32"]), device="cuda", dtype="float32")
    e = next(x for x in manifest["read"] if x["tag"] == "short")
    ids = s.tokenizers.encode_llm(read_prompt(e["text"]))
    spk, ref = s.speaker(ids).cpu(), eager.speaker(ids)
    assert (spk - ref).norm() <= 1e-3 * ref.norm()
    np.testing.assert_array_equal(s.say(e["text"], Sampling(greedy=True)).codes.cpu().numpy(),
                                  goldens["read_short_codes"])
