"""Parity of the codec stage (DVAE decoder + Vocos, one call and streamed) with the reference goldens.

Everything runs in float32 on the CPU; tolerances are PARITY.md's (mel 1e-4 there, 1e-5 here, which a
float32 implementation meets with room to spare: one-call decoding is bit-exact on the machine the
goldens came from, streamed chunks differ by ~2e-8 from the reference's crossfade rounding).
"""

from __future__ import annotations

import math

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


# -- speed: the mel resampled in time between the DVAE and Vocos ------------------------------------

SPEEDS = [0.5, 1.5, 2.0]


def _tone(f0: float, seconds: float, rate: int = 16000) -> torch.Tensor:
    """A voiced-like harmonic tone: the fundamental and three harmonics, each half as loud."""
    t = torch.arange(int(seconds * rate), dtype=torch.float64) / rate
    return sum(0.5**k * torch.sin(2 * torch.pi * (k + 1) * f0 * t) for k in range(4)).float() * 0.3


def _peaks_follow_sources(stretched: torch.Tensor, mel: torch.Tensor, speed: float) -> bool:
    """Whether every stretched frame's strongest mel bin is that of one of its two source frames."""
    pos = torch.arange(stretched.shape[-1], dtype=torch.float64) * speed
    lo = pos.floor().long().clamp(max=mel.shape[-1] - 1)
    hi = (lo + 1).clamp(max=mel.shape[-1] - 1)
    peaks, src = stretched.argmax(0), mel.argmax(0)
    return bool(((peaks == src[lo]) | (peaks == src[hi])).all())


@pytest.mark.parametrize("speed", SPEEDS)
def test_stretch_keeps_the_pitch(speed):
    """Pitch preserved, without listening: the log-mel (features.log_mel) of 200 Hz then 320 Hz
    harmonic tones goes through `stretch`, the function the codec applies before Vocos. Its frame
    count scales by 1/speed while each frame's strongest bin stays the one of the fundamental it came
    from (200 or 320 Hz), so the tempo changes and the pitch does not. The check can fail: speeding
    up the waveform instead (the naive way, which raises the pitch by `speed`) moves those peaks and
    is caught by the same assertion. (The tiny Vocos has random weights and cannot render a pitch, so
    the mel is where this is checked; `test_decode_at_is_stretch_then_vocos` ties it to the audio.)"""
    from minicpm_cli.engine.codec import stretch
    from minicpm_cli.engine.features import log_mel

    low, high = _tone(200, 0.5), _tone(320, 0.5)
    mel = log_mel(torch.cat([low, high]))  # (80, F)
    bin_low, bin_high = log_mel(low)[:, 10:-10].argmax(0).unique(), log_mel(high)[:, 10:-10].argmax(0).unique()
    assert len(bin_low) == len(bin_high) == 1 and bin_low != bin_high

    out = stretch(mel, speed)
    n = mel.shape[-1]
    assert out.shape == (mel.shape[0], math.ceil(n / speed))
    assert _peaks_follow_sources(out, mel, speed)
    src = torch.arange(out.shape[-1]) * speed  # source frames: the steady parts keep their fundamental
    assert (out.argmax(0)[(src > 10) & (src < n / 2 - 10)] == bin_low).all()
    assert (out.argmax(0)[(src > n / 2 + 10) & (src < n - 10)] == bin_high).all()

    # the control: the waveform itself sped up (pitch raised by `speed`) fails the same check
    wave = torch.cat([low, high]).numpy()
    fast = np.interp(np.arange(0, len(wave), speed), np.arange(len(wave)), wave).astype(np.float32)
    assert not _peaks_follow_sources(log_mel(torch.from_numpy(fast)), mel, speed)


def test_decode_at_is_stretch_then_vocos(codec, goldens):
    """Speed != 1 is the DVAE's mel, resampled by `stretch`, through Vocos; speed 1 is `decode` bit
    for bit (the plain path, whatever a backend made of it)."""
    from minicpm_cli.engine.codec import stretch

    codes = torch.from_numpy(goldens["decode_codes"])
    assert torch.equal(codec.decode_at(codes, 1.0), codec.decode(codes))
    for speed in SPEEDS:
        expected = codec.vocos(stretch(codec.mel(codes), speed)[None])[0]
        assert torch.equal(codec.decode_at(codes, speed), expected)


@pytest.mark.parametrize("speed", SPEEDS)
def test_stretched_windows_line_up_with_the_whole(speed):
    """Chunk boundaries stay seamless: a window [a, b) of a segment's mel, stretched with its place
    `a`, gives exactly the frames of the whole mel's stretch for that span (those before the window's
    last frame; the last ones, clamped, are the next window's context). A stretch relative to each
    window (F.interpolate per chunk) would shift them by up to a frame at every chunk."""
    from minicpm_cli.engine.codec import stretch, stretched_frames

    mel = torch.randn(3, 120, dtype=torch.float64)
    whole = stretch(mel, speed)
    for a, b in [(0, 50), (42, 100), (92, 120), (7, 9)]:
        part = stretch(mel[:, a:b], speed, a)
        first = stretched_frames(a, speed)
        assert part.shape[-1] == stretched_frames(b, speed) - first
        exact = (torch.arange(first, first + part.shape[-1]) * speed <= b - 1).numpy()
        torch.testing.assert_close(part[:, exact], whole[:, first : first + part.shape[-1]][:, exact],
                                   rtol=0, atol=1e-12)


@pytest.mark.parametrize("speed", SPEEDS)
@pytest.mark.parametrize("step", [25, 7])
def test_stream_at_speed(codec, goldens, speed, step):
    """Duration within 3% of 1/speed of speed 1's, streamed as in one call (the same total, sample
    for sample in count); the first chunk leaves at once, all but its context's span; each crossfade
    spans exactly the audio its context decodes again, so the streamed audio stays as close to the
    one-call decode as at speed 1."""
    from minicpm_cli.engine.codec import samples_at

    codes = torch.from_numpy(goldens["reply_fine_codes"])
    one = codec.decode_at(codes, speed)
    assert abs(len(one) / (512 * len(codes) / speed) - 1) < 0.03
    stream = StreamDecoder(codec, hold_first=False, speed=speed)
    first = stream.feed(codes[:step])
    assert len(first) == samples_at(codec, step - 4, speed)
    streamed = torch.cat([first] + run_stream(stream, codes[step:], step))
    assert len(streamed) == len(one)
    # (at speed 1 the stitched audio differs from the one-call decode by the chunks' missing right
    # context, up to ~0.07 here: a misplaced crossfade adds the chunk-to-chunk jump on top)
    plain = run_stream(StreamDecoder(codec, hold_first=False), codes, step)
    bound = 1.6 * float((torch.cat(plain) - codec.decode(codes)).abs().max())
    assert float((streamed - one).abs().max()) < bound


def test_stream_at_speed_holds_first_as_the_reference(codec, goldens):
    """hold_first at another speed: the same audio as released early, only later."""
    codes = torch.from_numpy(goldens["reply_fine_codes"])
    held = run_stream(StreamDecoder(codec, hold_first=True, speed=1.5), codes)
    early = run_stream(StreamDecoder(codec, hold_first=False, speed=1.5), codes)
    assert torch.equal(torch.cat(held), torch.cat(early))


def test_speed_one_streams_the_plain_path(codec, goldens, decoded_windows):
    """speed=1.0 decodes the very windows of today's path and gives its samples bit for bit."""
    codes = torch.from_numpy(goldens["reply_fine_codes"])
    plain = run_stream(StreamDecoder(codec, hold_first=True), codes)
    n = len(decoded_windows)
    at_one = run_stream(StreamDecoder(codec, hold_first=True, speed=1.0), codes)
    assert len(decoded_windows) == 2 * n
    assert all(torch.equal(a, b) for a, b in zip(decoded_windows[:n], decoded_windows[n:]))
    assert len(plain) == len(at_one) and all(torch.equal(a, b) for a, b in zip(plain, at_one))
    assert_close(torch.cat(at_one), goldens["reply_fine_wav"])


def test_codec_lane_at_speed_decodes_as_the_codec(codec, goldens):
    """A batch's lane (batching.CodecLane) decodes another speed on the codec's own halves, so a
    stream's audio is the single stream's; speed 1 goes through the batch's decoder."""
    from minicpm_cli.engine.batching import CodecLane

    asked = []
    lane = CodecLane(codec, 3, lambda row, codes: asked.append(row) or codec.decode(codes))
    codes = torch.from_numpy(goldens["reply_fine_codes"])
    for speed in (1.0, 1.5):
        alone = run_stream(StreamDecoder(codec, hold_first=False, speed=speed), codes)
        laned = run_stream(StreamDecoder(lane, hold_first=False, speed=speed), codes)
        assert torch.equal(torch.cat(alone), torch.cat(laned))
        assert bool(asked) == (speed == 1.0)
        asked.clear()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_istft_takes_dc_and_nyquist_as_real(device):
    """The head's DC and Nyquist bins carry imaginary parts, which an inverse real FFT must drop
    (pocketfft does; cuFFT kept them in a batch of 8, 4.7e-3 off): a row alone, the same row in a
    batch, and the row with those parts zeroed give the same samples. The CUDA case failed before the
    fix; on a CPU pocketfft drops those parts itself, so there the test guards the transform against a
    change of implementation."""
    from minicpm_cli.models.vocos import ISTFT

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    istft = ISTFT(VocosConfig()).to(device)  # (n_fft 1024, hop 256: the real sizes)
    g = torch.Generator().manual_seed(0)
    spec = torch.complex(torch.randn(1, 513, 137, generator=g), torch.randn(1, 513, 137, generator=g)).to(device)
    real_ends = spec.clone()
    real_ends[:, [0, -1]] = real_ends[:, [0, -1]].real.to(spec.dtype)
    alone = istft(spec)[0]
    torch.testing.assert_close(istft(spec.expand(8, -1, -1).contiguous())[0], alone, rtol=0, atol=1e-6)
    torch.testing.assert_close(istft(real_ends)[0], alone, rtol=0, atol=1e-6)


@pytest.mark.parametrize("invariant", [False, True])
def test_graph_codec_keeps_graphs_of_recent_segment_lengths_only(monkeypatch, invariant):
    """compile's CUDA-graph codec: a graph for each decode length up to GRAPH_FRAMES, but past a
    streamed chunk's lengths (short segments, each of a length of its own) only the KEPT_LENGTHS most
    recently used stay; the least recently used is dropped, and captured again when its length comes
    back. Longer segments run eagerly, with no graph."""
    pytest.importorskip("triton")
    from minicpm_cli.backends.compile import FRAMES_PER_CALL, GraphCodec

    class Codec:  # (audio: each frame's code sum, twice)
        num_vq, device = 4, torch.device("cpu")

        def decode(self, codes):
            return self.decode_batch(codes[None])[0]

        def decode_batch(self, codes):
            return codes.sum(2).float().repeat_interleave(2, 1)

    class Graphs:  # (what a CUDA device's graphs would keep, and how often each key was captured)
        def __init__(self):
            self.kept, self.captures = {}, {}

        def run(self, key, fn):
            if key not in self.kept:
                self.captures[key] = self.captures.get(key, 0) + 1
                self.kept[key] = True
            return fn()

        def drop(self, key):
            del self.kept[key]

    monkeypatch.setattr(GraphCodec, "KEPT_LENGTHS", 3)
    codec = GraphCodec(Codec(), invariant=invariant)
    graphs = codec.graphs = Graphs()
    chunk, first = FRAMES_PER_CALL + 4, FRAMES_PER_CALL + 5  # (a streamed chunk's; a segment's)

    def decode(t):
        codes = torch.randint(0, 100, (t, 4))
        assert torch.equal(codec.decode(codes), codes.sum(1).float().repeat_interleave(2))

    def lengths():
        return sorted(k if isinstance(k, int) else k[1] for k in graphs.kept)

    for t in (chunk, first, first + 1, first + 2, first + 3):
        decode(t)
    assert lengths() == [chunk, first + 1, first + 2, first + 3]  # (the oldest segment's dropped)
    decode(first + 1)  # (used again: now the most recent)
    decode(first)
    assert lengths() == [chunk, first, first + 1, first + 3]
    assert list(graphs.captures.values()).count(2) == 1  # (`first` captured again, nothing else)
    decode(GraphCodec.GRAPH_FRAMES + 1)  # (a segment decoded whole: eagerly, no graph of its length)
    assert lengths() == [chunk, first, first + 1, first + 3]
