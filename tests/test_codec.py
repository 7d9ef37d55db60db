"""Parity of the codec stage (DVAE decoder + Vocos, one call and streamed) with the reference goldens.

Everything runs in float32 on the CPU; tolerances are PARITY.md's (mel 1e-4 there, 1e-5 here, which a
float32 implementation meets with room to spare: one-call decoding is bit-exact on the machine the
goldens came from, streamed chunks differ by ~2e-8 from the reference's crossfade rounding).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minicpm_cli.engine.codec import StreamDecoder
from minicpm_cli.models.dvae import DVAEConfig
from minicpm_cli.models.vocos import VocosConfig

ATOL = 1e-5
STEP = 25  # frames per TTS generate call in the reference's streaming path


def assert_close(actual, expected, atol=ATOL):
    actual = actual.numpy() if isinstance(actual, torch.Tensor) else actual
    assert actual.shape == expected.shape
    err = float(np.abs(actual - expected).max()) if actual.size else 0.0
    assert err <= atol, f"max abs error {err:.3g} > {atol:g}"


def run_stream(stream: StreamDecoder, codes: torch.Tensor, step: int = STEP) -> list[torch.Tensor]:
    """Feed `codes` in `step`-frame calls (the last one the remainder), then flush: every piece emitted."""
    pieces = [stream.feed(codes[i : i + step]) for i in range(0, len(codes), step)] + [stream.flush()]
    return [p for p in pieces if p is not None and len(p)]


@pytest.fixture
def decoded_windows(codec, monkeypatch):
    """Records the code windows the codec is asked to decode."""
    windows, decode = [], codec.decode

    def recording_decode(codes):
        windows.append(codes.clone())
        return decode(codes)

    monkeypatch.setattr(codec, "decode", recording_decode)
    return windows


def test_configs_from_shapes(codec, manifest):
    dims = manifest["inferred_hardcoded_dims"]
    d, v = codec.dvae.config, codec.vocos.config
    assert d == DVAEConfig(group_dim=dims["D"], idim=dims["D"], bn_dim=dims["bn_dim"], hidden=dims["hidden"],
                           odim=dims["D"], n_layer=dims["n_layer"])
    assert d.groups * d.group_dim == dims["vq_dim"] and d.num_vq == 4
    assert v == VocosConfig(dim=dims["vocos_dim"], intermediate_dim=dims["vocos_inter"],
                            num_layers=dims["vocos_layers"])
    assert codec.samples_per_frame == 512


def test_parameter_names_are_the_checkpoints(codec, tiny_dir):
    from safetensors import safe_open

    with safe_open(tiny_dir / "model.safetensors", framework="pt") as f:
        stored = {k.removeprefix("tts.dvae.") for k in f.keys() if k.startswith("tts.dvae.")}
    used = {k for k in stored if not k.startswith(("encoder.", "downsample_conv.")) and ".project_in." not in k}
    assert set(codec.dvae.state_dict()) == used
    vocos = torch.load(tiny_dir / "assets" / "Vocos.pt", weights_only=True)
    assert set(codec.vocos.state_dict()) == {k for k in vocos if not k.startswith("feature_extractor.")}


@pytest.mark.parametrize("name", ["decode", "read_short", "read_punct", "read_digits"])
def test_one_call_decode(codec, goldens, name):
    codes = torch.from_numpy(goldens[f"{name}_codes"])
    assert_close(codec.mel(codes), goldens[f"{name}_mel"])
    wav = codec.decode(codes)
    assert wav.dtype == torch.float32 and wav.shape == (512 * len(codes),)
    assert_close(wav, goldens[f"{name}_wav"])


def test_batched_dvae_matches_single(codec, goldens):
    """Batching changes only float rounding (other GEMM blocking), not which frames mix."""
    codes = torch.from_numpy(goldens["decode_codes"])
    with torch.inference_mode():
        batch = codec.dvae(torch.stack([codes, codes.flip(0)]))
    torch.testing.assert_close(batch[0], codec.mel(codes), atol=1e-5, rtol=0)
    torch.testing.assert_close(batch[1], codec.mel(codes.flip(0)), atol=1e-5, rtol=0)


def test_stream_decode(codec, goldens):
    pieces = run_stream(StreamDecoder(codec, hold_first=True), torch.from_numpy(goldens["decode_codes"]))
    assert [len(p) for p in pieces] == [12800, 12800, 5120]
    for i, p in enumerate(pieces):
        assert_close(p, goldens[f"decode_stream_chunk{i}"])
    assert_close(torch.cat(pieces), goldens["decode_stream_wav"])


@pytest.mark.parametrize("tag", ["name", "fine"])
def test_stream_reply(codec, goldens, decoded_windows, tag):
    pieces = run_stream(StreamDecoder(codec, hold_first=True), torch.from_numpy(goldens[f"reply_{tag}_codes"]))
    n_decodes = sum(1 for k in goldens.files if k.startswith(f"reply_{tag}_decode"))
    assert len(decoded_windows) == n_decodes
    for i, window in enumerate(decoded_windows):
        np.testing.assert_array_equal(window.numpy(), goldens[f"reply_{tag}_decode{i}_codes"])
    assert len(pieces) == sum(1 for k in goldens.files if k.startswith(f"reply_{tag}_chunk"))
    for i, p in enumerate(pieces):
        assert_close(p, goldens[f"reply_{tag}_chunk{i}_wav"])
    assert_close(torch.cat(pieces), goldens[f"reply_{tag}_wav"])


def test_stream_segment_continuation(codec, goldens, decoded_windows):
    """reply_long: segment 0 ends, segment 1 starts from 50 carried frames (the last 4 as context)."""
    seg0, seg1 = (torch.from_numpy(goldens[f"reply_long_seg{k}_codes"]) for k in (0, 1))
    carried = torch.from_numpy(goldens["reply_long_seg1_seed_audio_codes"])
    assert torch.equal(seg1[:50], carried) and torch.equal(seg0[-50:], carried)
    stream = StreamDecoder(codec, hold_first=True)
    pieces = run_stream(stream, seg0)
    stream.reset(carried)
    pieces += run_stream(stream, seg1[50:])
    for i, window in enumerate(decoded_windows):
        np.testing.assert_array_equal(window.numpy(), goldens[f"reply_long_decode{i}_codes"])
    assert len(decoded_windows) == 18 and len(pieces) == 18
    for i, p in enumerate(pieces):
        assert_close(p, goldens[f"reply_long_chunk{i}_wav"])
    assert_close(torch.cat(pieces), goldens["reply_long_wav"])


@pytest.mark.parametrize("step", [25, 7, 3])
def test_early_first_chunk_gives_the_same_audio(codec, goldens, step):
    codes = torch.from_numpy(goldens["reply_fine_codes"])
    held = run_stream(StreamDecoder(codec, hold_first=True), codes, step)
    early_stream = StreamDecoder(codec, hold_first=False)
    first = early_stream.feed(codes[:step])
    early = [first] + run_stream(early_stream, codes[step:], step)
    if step >= 4:  # all but the 4 frames the next chunk crossfades come out at once
        assert len(first) == 512 * (step - 4)
    assert torch.equal(torch.cat(held), torch.cat([p for p in early if p is not None]))
    assert len(torch.cat(held)) == 512 * len(codes)


def test_early_first_chunk_with_continuation(codec, goldens):
    seg0, seg1 = (torch.from_numpy(goldens[f"reply_long_seg{k}_codes"]) for k in (0, 1))
    out = {}
    for hold_first in (True, False):
        stream = StreamDecoder(codec, hold_first=hold_first)
        pieces = run_stream(stream, seg0)
        stream.reset(seg1[:50])
        out[hold_first] = torch.cat(pieces + run_stream(stream, seg1[50:]))
    assert torch.equal(out[True], out[False])
    assert len(out[False]) == 512 * (len(seg0) + len(seg1) - 50) + 2048  # the re-decoded context


def test_stream_edge_cases(codec, goldens):
    codes = torch.from_numpy(goldens["decode_codes"])
    stream = StreamDecoder(codec, hold_first=True)
    assert stream.feed(codes[:0]) is None
    assert stream.feed(codes[:25]) is None  # the reference holds the first chunk back
    assert len(stream.flush()) == 12800  # a reply that ends after one chunk
    assert len(stream.flush()) == 0
    assert_close(run_stream(stream, codes)[0], goldens["decode_stream_chunk0"])  # flush left a fresh stream
