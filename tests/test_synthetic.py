"""The synthetic checkpoint writer reproduces the official layout (checked against the tiny fixture)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from minicpm_cli.engine.synthetic import SyntheticSpec, parameter_count, random_tensors, random_vocos_state, tensor_plan, write_checkpoint

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-minicpmo"
VOICE_EXTRA = FIXTURE.parent / "tiny-minicpmo-voice-extra"
SPEECH = ("llm.", "tts.")
AUDIO = ("apm.", "audio_projection_layer.")


def _fixture_shapes() -> dict[str, tuple[int, ...]]:
    with safe_open(FIXTURE / "model.safetensors", "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _load_dir(d: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(d.glob("model*.safetensors")) for k, v in load_file(f).items()}


def test_tiny_names_shapes_dtypes_match_fixture():
    mine = dict(random_tensors(SyntheticSpec.tiny(), seed=0))
    assert {k: tuple(v.shape) for k, v in mine.items()} == _fixture_shapes()
    assert {v.dtype for v in mine.values()} == {torch.bfloat16}


def test_tiny_values_have_realistic_scales():
    t = {k: v.float() for k, v in random_tensors(SyntheticSpec.tiny(), seed=3)}
    g = torch.cat([t[f"tts.head_code.{q}.parametrizations.weight.original0"] for q in range(4)])
    assert g.min() >= 0.5 and g.max() <= 1.5
    assert t["tts.head_code.0.parametrizations.weight.original0"][625].item() == 1.5  # EOS gain
    assert 0.5 <= t["tts.dvae.coef"].min() and t["tts.dvae.coef"].max() <= 1.5
    assert abs(t["llm.model.norm.weight"].mean().item() - 1.0) < 0.05
    assert abs(t["tts.dvae.decoder.decoder_block.0.coef"].mean().item() - 0.3) < 0.06
    assert t["llm.model.layers.0.self_attn.q_proj.bias"].abs().min() > 0
    assert abs(t["llm.model.layers.0.mlp.down_proj.weight"].std().item() - 128**-0.5) < 0.01  # fan-in


def test_values_are_seeded_per_tensor():
    a = dict(random_tensors(SyntheticSpec.tiny(), seed=1))
    b = dict(random_tensors(SyntheticSpec.tiny(), seed=1, include_unused=False))
    c = dict(random_tensors(SyntheticSpec.tiny(), seed=2))
    assert set(b) < set(a) and all(torch.equal(a[k], b[k]) for k in b)
    assert "tts.dvae.encoder.conv_out.weight" not in b and "tts.model.embed_tokens.weight" not in b
    assert not torch.equal(a["llm.lm_head.weight"], c["llm.lm_head.weight"])


def test_single_file_write_matches_fixture_layout(tmp_path):
    out = write_checkpoint(tmp_path / "ckpt", SyntheticSpec.tiny(), tokenizer_from=FIXTURE, seed=0)
    assert json.loads((out / "config.json").read_text()) == json.loads((FIXTURE / "config.json").read_text())
    assert not (out / "model.safetensors.index.json").exists()
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == _fixture_shapes()
    for rel in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "preprocessor_config.json",
                *(p.relative_to(FIXTURE) for p in (FIXTURE / "assets/chattts_tokenizer").iterdir())]:
        assert (out / rel).read_bytes() == (FIXTURE / rel).read_bytes(), rel


def test_sharded_write_has_a_valid_index(tmp_path):
    spec = SyntheticSpec.tiny()
    single = _load_dir(write_checkpoint(tmp_path / "one", spec, tokenizer_from=FIXTURE, seed=5))
    out = write_checkpoint(tmp_path / "sharded", spec, tokenizer_from=FIXTURE, seed=5, max_shard_bytes=1 << 20)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 2 and not (out / "model.safetensors").exists()
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(p.name for p in out.glob("model-*.safetensors")) == files
    assert set(index["weight_map"]) == {name for name, _, _ in tensor_plan(spec)}
    loaded = {}
    for name in files:
        with safe_open(out / name, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            keys = set(f.keys())
        assert keys == {k for k, v in index["weight_map"].items() if v == name}
        shard = load_file(out / name)
        big = [v.numel() * 2 for v in shard.values()]
        assert sum(big) <= 1 << 20 or len(big) == 1  # a tensor above the limit sits alone, as in HF
        loaded.update(shard)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in loaded.values())
    assert loaded.keys() == single.keys() and all(torch.equal(loaded[k], single[k]) for k in single)


def test_vision_audio_tensors_get_their_own_shard(tmp_path):
    out = write_checkpoint(tmp_path / "va", SyntheticSpec.tiny(), tokenizer_from=FIXTURE, include_vision_audio=True)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    speech_files = {f for k, f in weight_map.items() if k.startswith(SPEECH)}
    other_files = {f for k, f in weight_map.items() if not k.startswith(SPEECH)}
    assert len(speech_files) == 1 and len(other_files) == 1 and not speech_files & other_files
    prefixes = {k.split(".")[0] for k in weight_map if not k.startswith(SPEECH)}
    assert prefixes == {"vpm", "resampler", "apm", "audio_projection_layer"}
    assert set(load_file(out / other_files.pop())) == {k for k in weight_map if not k.startswith(SPEECH)}


def test_corrupt_hook_drops_or_replaces_tensors(tmp_path):
    gone, bad = "tts.dvae.coef", "llm.model.norm.weight"
    hook = lambda name, t: None if name == gone else (t[:-1] if name == bad else t)  # noqa: E731
    out = write_checkpoint(tmp_path / "bad", SyntheticSpec.tiny(), tokenizer_from=FIXTURE, corrupt=hook)
    t = load_file(out / "model.safetensors")
    assert gone not in t and t[bad].shape == (63,)


def test_vocos_state_matches_fixture(tmp_path):
    out = write_checkpoint(tmp_path / "ckpt", SyntheticSpec.tiny(), tokenizer_from=FIXTURE)
    mine = torch.load(out / "assets/Vocos.pt", weights_only=True)
    ref = torch.load(FIXTURE / "assets/Vocos.pt", weights_only=True)
    assert list(mine) == list(ref)
    assert {k: (v.shape, v.dtype) for k, v in mine.items()} == {k: (v.shape, v.dtype) for k, v in ref.items()}
    for key in ("feature_extractor.mel_spec.spectrogram.window", "head.istft.window"):
        assert torch.equal(mine[key], torch.hann_window(1024))
    fb = "feature_extractor.mel_spec.mel_scale.fb"
    torch.testing.assert_close(mine[fb], ref[fb], atol=1e-6, rtol=0)
    assert mine["head.out.bias"][:513].mean() < -0.5  # log-magnitudes start small: no exp() blow-up


def test_full_preset_sizes_from_shapes_only():
    spec = SyntheticSpec.full()
    h, layers, inter, vocab, kv = 3584, 28, 18944, 151700, 512
    attn = 2 * h * h + 2 * h * kv + h + 2 * kv  # q, o, k, v weights; q, k, v biases
    qwen2_7b = 2 * vocab * h + h + layers * (attn + 3 * h * inter + 2 * h)  # embed, lm_head, final norm
    assert parameter_count(spec, "llm.") == qwen2_7b
    assert abs(qwen2_7b - 7.6e9) < 0.05e9
    # the official 17.35 GB bf16 checkpoint holds ~8.7e9 parameters; ~0.8e9 of them are vpm/apm/resampler,
    # which the speech path does not use, so llm + tts come to ~7.86e9
    assert 7.8e9 < parameter_count(spec) < 7.95e9
    assert 0.2e9 < parameter_count(spec, "tts.") < 0.3e9
    shapes = {name: shape for name, shape, _ in tensor_plan(spec)}
    assert shapes["tts.projector.linear1.weight"] == (768, 3584)
    assert shapes["tts.dvae.decoder.conv_out.weight"] == (512, 256, 1)
    assert shapes["tts.dvae.encoder.conv_out.weight"] == (1024, 256, 1)
    assert shapes["tts.dvae.vq_layer.quantizer.rvqs.0.project_out.weight"] == (512, 4)
    assert len([k for k in shapes if re.fullmatch(r"tts\.dvae\.decoder\.decoder_block\.\d+\.coef", k)]) == 12
    vocos = random_vocos_state(spec, seed=0)
    assert vocos["backbone.embed.weight"].shape == (512, 100, 7)
    assert 13.5e6 < sum(math.prod(v.shape) for v in vocos.values()) < 13.7e6  # Vocos.pt is 54.4 MB fp32


def test_spec_validation_names_the_conflict():
    with pytest.raises(ValueError, match="tts_llm_dim"):
        SyntheticSpec(hidden=64, heads=4, kv_heads=2)


def test_large_tensors_are_drawn_in_slices_into_the_target_dtype(monkeypatch):
    """Over DRAW_CHUNK elements a tensor is drawn slice by slice straight into its dtype (a
    full-size embedding never exists whole in float32); the checkpoint writer and the on-demand
    random checkpoint still give the same values, with the same statistics."""
    from minicpm_cli.engine import synthetic

    monkeypatch.setattr(synthetic, "DRAW_CHUNK", 1000)
    spec = SyntheticSpec.tiny()
    ck = synthetic.RandomCheckpoint(spec, seed=3)
    key = "llm.model.embed_tokens.weight"
    t = ck.tensor(key, torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.numel() > 1000
    written = dict(random_tensors(spec, seed=3, dtype=torch.bfloat16, include_unused=False))[key]
    assert torch.equal(t, written)
    monkeypatch.setattr(synthetic, "DRAW_CHUNK", 1 << 25)
    whole = ck.tensor(key, torch.bfloat16)
    assert torch.equal(t, whole)  # on the CPU the generator's stream is the same, sliced or whole
    assert abs(t.float().std() - 1.0) < 0.05  # the embedding is drawn N(0, 1)


# --- the audio encoder (voices) ---------------------------------------------------------------------

def test_tiny_audio_encoder_matches_the_voice_fixture(tmp_path):
    """With `include_audio` the tiny spec writes tiny-minicpmo-voice: the encoder's 41 tensors by name
    and shape, in a shard of their own, and its config.json (tiny audio_config, init_audio, chunk_input)."""
    with safe_open(VOICE_EXTRA / "audio.safetensors", "pt") as f:
        want = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    out = write_checkpoint(tmp_path / "voice", SyntheticSpec.tiny(), tokenizer_from=FIXTURE, include_audio=True)
    assert json.loads((out / "config.json").read_text()) == json.loads((VOICE_EXTRA / "config.json").read_text())
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    audio_files = {f for k, f in weight_map.items() if k.startswith(AUDIO)}
    assert len(audio_files) == 1 and not audio_files & {f for k, f in weight_map.items() if k.startswith(SPEECH)}
    written = load_file(out / audio_files.pop())
    assert {k: tuple(v.shape) for k, v in written.items()} == want
    assert {k for k in weight_map if not k.startswith(SPEECH)} == set(want)


def test_full_audio_encoder_is_whisper_mediums():
    spec = SyntheticSpec.full()
    d, ffn, layers, h = 1024, 4096, 24, 3584
    layer = 4 * d * d + 3 * d + 2 * d * ffn + ffn + d + 4 * d  # q/k/v/out (k without bias), fc1/fc2, 2 norms
    whisper = 80 * d * 3 + d + d * d * 3 + d + 1500 * d + layers * layer + 2 * d
    assert parameter_count(spec, "apm.", include_audio=True) == whisper
    assert abs(whisper - 307e6) < 1e6  # Whisper-medium's encoder
    assert parameter_count(spec, "audio_projection_layer.", include_audio=True) == d * h + h + h * h + h
    assert parameter_count(spec, "apm.") == 0  # (only with include_audio)
    shapes = {name: shape for name, shape, _ in tensor_plan(spec, include_audio=True)}
    assert shapes["apm.conv2.weight"] == (1024, 1024, 3) and shapes["apm.embed_positions.weight"] == (1500, 1024)
    assert shapes["apm.layers.23.fc1.weight"] == (4096, 1024) and "apm.layers.0.self_attn.k_proj.bias" not in shapes
    assert shapes["audio_projection_layer.linear1.weight"] == (3584, 1024)


def test_audio_encoder_values_have_realistic_scales():
    t = {k: v.float() for k, v in random_tensors(SyntheticSpec.tiny(), seed=3, include_audio=True) if k.startswith(AUDIO)}
    assert abs(t["apm.layers.0.final_layer_norm.weight"].mean().item() - 1.0) < 0.05
    assert abs(t["apm.layers.0.fc2.weight"].std().item() - 256**-0.5) < 0.01  # fan-in
    assert abs(t["apm.conv1.weight"].std().item() - (80 * 3) ** -0.5) < 0.01
    assert t["apm.embed_positions.weight"].abs().max() < 0.2  # small learned positions
    assert t["apm.layers.1.self_attn.q_proj.bias"].abs().min() > 0


def test_random_checkpoint_serves_the_audio_encoder():
    """The on-demand checkpoint has the encoder: keys, shapes, the values write_checkpoint writes
    (same seed, same tensors; another seed, others) and a config whose audio_config fits them."""
    from minicpm_cli.engine import synthetic
    from minicpm_cli.models.audio_encoder import AudioEncoderConfig

    spec = SyntheticSpec.tiny()
    ck = synthetic.RandomCheckpoint(spec, seed=3)
    keys = ck.keys("apm.") + ck.keys("audio_projection_layer.")
    assert len(keys) == 41 and ck.shape("apm.conv1.weight") == (64, 80, 3)
    written = {k: v for k, v in random_tensors(spec, seed=3, include_audio=True) if k.startswith(AUDIO)}
    assert sorted(written) == keys
    assert all(torch.equal(ck.tensor(k, torch.bfloat16), written[k]) for k in keys)
    other = synthetic.RandomCheckpoint(spec, seed=4)
    assert not torch.equal(ck.tensor("apm.layers.0.fc1.weight"), other.tensor("apm.layers.0.fc1.weight"))
    c = AudioEncoderConfig.from_hf(ck.config)
    assert (c.dim, c.n_layers, c.n_heads, c.ffn, c.n_mels, c.max_positions, c.llm_dim, c.pool) == \
        (64, 2, 4, 256, 80, 1500, 64, 2)
    full = AudioEncoderConfig.from_hf(synthetic.RandomCheckpoint(SyntheticSpec.full()).config)
    assert (full.dim, full.n_layers, full.n_heads, full.ffn, full.llm_dim) == (1024, 24, 16, 4096, 3584)
