"""Streaming: reply parity with the reference, chunk timing, long texts, sinks and signals."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from minicpm_cli.engine.llm import LLMSampling, reply_pieces
from minicpm_cli.engine.pipeline import Synthesizer
from minicpm_cli.engine.sampling import Sampling
from minicpm_cli.engine.streaming import sentence_end, spell_numbers
from minicpm_cli.engine.text import read_pieces

from conftest import pythonpath

REPLIES = ["name", "fine", "long"]
WORDS = ("the leaves of the old maple turn red and gold when autumn nights grow cold and the light "
         "fades early, while children gather acorns by the river and birds fly south").split()


@pytest.fixture(scope="module")
def synth(tiny_dir):
    return Synthesizer.load(str(tiny_dir), device="cpu", dtype="float32")


def _reply_entry(manifest, tag):
    return next(e for e in manifest["reply"] + manifest["long_reply"] if e["tag"] == tag)


def long_text(words: int) -> str:
    out, i = [], 0
    while len(out) < words:
        sentence = [WORDS[(i + k) % len(WORDS)] for k in range(7 + i % 9)]
        out.extend(sentence[:-1] + [sentence[-1] + (". " if i % 3 else ", ")])
        i += 1
    return " ".join(out[:words]).replace(" .", ".").strip().rstrip(",") + "."


@pytest.mark.parametrize("tag", REPLIES)
def test_reply_llm_tokens(synth, goldens, manifest, tag):
    e = _reply_entry(manifest, tag)
    pieces = reply_pieces(synth.llm, synth.tokenizers, e["user_text"], LLMSampling(), None, e["llm_max_new_tokens"])
    ids = [i for p in pieces for i in p.ids]
    gold = goldens[f"reply_{tag}_llm_new_tokens"].tolist()
    # reply_name: the TTS ended while the LLM was still running; the reference stopped pulling
    # tokens there (18), we ran the LLM to its limit here: the prefix is what must agree.
    assert ids[: len(gold)] == gold


@pytest.mark.parametrize("tag", REPLIES)
def test_reply_codes_and_waveform(synth, goldens, manifest, tag):
    e = _reply_entry(manifest, tag)
    chunks = list(synth.reply(e["user_text"], Sampling(greedy=True), max_tokens=e["llm_max_new_tokens"]))
    codes = torch.cat([c.codes for c in chunks]).numpy()
    np.testing.assert_array_equal(codes, goldens[f"reply_{tag}_codes"])
    wav = np.concatenate([c.samples for c in chunks])
    np.testing.assert_allclose(wav, goldens[f"reply_{tag}_wav"], atol=1e-5, rtol=0)
    # the reply text: the raw LLM text read by the TTS (the reference's yield texts), each once
    assert "".join(c.text for c in chunks) == "".join(e["generated_text_per_chunk"])
    segments = {c.segment for c in chunks}
    assert len(segments) == e.get("segments_count", 1)
    assert chunks[-1].final


def test_reply_command_reproduces_golden(tiny_dir, goldens, manifest, tmp_path):
    e = _reply_entry(manifest, "fine")
    out = tmp_path / "x.wav"
    p = _run("reply", e["user_text"], "--model", str(tiny_dir), "--greedy", "--max-tokens", "24", "--device", "cpu",
             "--dtype", "float32", "--pcm", "f32", "-o", str(out))
    assert p.returncode == 0, p.stderr.decode()
    assert p.stdout == b""
    assert p.stderr.decode().strip() == e["generated_text"].strip()
    wav, sr = sf.read(out, dtype="float32")
    np.testing.assert_allclose(wav, goldens["reply_fine_wav"], atol=1e-5, rtol=0)


def test_exclamation_marks_are_kept(synth):
    """Deliberate difference: the reference's _decode_text drops every id 0 (taking it for padding),
    which in the Qwen2 vocabulary is "!"; we keep it. The goldens have no id 0 in generated text."""
    from minicpm_cli.engine.llm import _decode

    tok = synth.tokenizers
    bang = tok.encode_llm("!")
    assert bang == [0]
    assert _decode(tok, tok.encode_llm("Hi") + bang, {tok.im_end_id}) == "Hi!"


def test_number_spelling_and_sentence_end():
    assert spell_numbers("written8 boat", "english") == "writteneight boat"
    assert spell_numbers("I have 23 books", "english") == "I have two three books"
    assert spell_numbers("我有2个", "chinese") == "我有二个"
    assert sentence_end('slice."nn') == "."
    assert sentence_end("pi is 3.14 ok?") == "?"  # a dot after a digit does not end a sentence
    assert sentence_end("no end") == ""


def test_first_chunk_leaves_before_second_is_computed(synth):
    calls = []
    original = synth.tts.generate

    def counting(*args, **kwargs):
        calls.append(args[1] if len(args) > 1 else kwargs.get("n_steps", 25))
        return original(*args, **kwargs)

    synth.tts.generate = counting
    try:
        for first_chunk in (25, 5):
            calls.clear()
            stream = synth.synthesize("Good morning! Could you tell me the way to the library?", Sampling(greedy=True),
                                      first_chunk=first_chunk)
            first = next(stream)
            assert len(first.samples) > 0
            assert len(calls) == 1, "the first audio must come out after the first generation call"
            assert len(first.codes) == first_chunk
            rest = list(stream)
            assert len(calls) > 1 and rest
    finally:
        synth.tts.generate = original


def test_first_chunk_size_keeps_codes(synth):
    text = "Good morning! Could you tell me the way to the library?"
    a = torch.cat([c.codes for c in synth.synthesize(text, Sampling(greedy=True), first_chunk=25)])
    b = torch.cat([c.codes for c in synth.synthesize(text, Sampling(greedy=True), first_chunk=3)])
    assert torch.equal(a, b)


def test_read_pieces_keep_every_character(synth):
    text = long_text(400)
    count = lambda t: len(synth.tokenizers.encode_bert(t))  # noqa: E731
    pieces = read_pieces(text, count)
    assert "".join(pieces) == text
    assert max(count(p) for p in pieces) <= 50


def segments(chunks) -> dict[int, list]:
    """A stream's chunks by segment number."""
    out: dict[int, list] = {}
    for c in chunks:
        out.setdefault(c.segment, []).append(c)
    return out


def test_long_text_reads_every_segment(synth):
    """2,000 words: every piece of text is read by exactly one segment, every segment has audio,
    and no segment's text exceeds the TTS window."""
    text = long_text(2000)
    chunks = list(synth.synthesize(text, Sampling(greedy=True), decode="segment"))
    assert "".join(c.text for c in chunks) == text
    by_segment = segments(chunks)
    assert len(by_segment) > 10
    for seg, cs in by_segment.items():
        frames = sum(len(c.codes) for c in cs)
        samples = sum(len(c.samples) for c in cs)
        assert frames > 0 and samples == frames * 512, seg
        assert len(synth.tokenizers.encode_bert("".join(c.text for c in cs))) < 300


def _run(*args, stdin=b"", **kw):
    env = {**os.environ, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1"}
    env.pop("MINICPM_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "minicpm_cli", *args], input=stdin, capture_output=True, env=env,
                          timeout=600, **kw)


def test_raw_is_two_bytes_per_sample_and_stdout_is_payload_only(tiny_dir):
    common = ("--model", str(tiny_dir), "--greedy", "--device", "cpu")
    wav = _run("say", *common, stdin=b"Hello world.")
    raw = _run("say", "--raw", *common, stdin=b"Hello world.")
    assert wav.returncode == 0 and raw.returncode == 0, wav.stderr + raw.stderr
    audio, sr = sf.read(io.BytesIO(wav.stdout), dtype="int16")
    assert wav.stdout[:4] == b"RIFF" and len(wav.stdout) == 44 + 2 * len(audio)
    assert len(raw.stdout) == 2 * len(audio)
    assert raw.stdout == wav.stdout[44:]
    f32 = _run("say", "--raw", "--pcm", "f32", *common, stdin=b"Hello world.")
    assert len(f32.stdout) == 4 * len(audio)


def test_lines_into_files_and_into_one_stream(tiny_dir, tmp_path):
    common = ("--model", str(tiny_dir), "--greedy", "--device", "cpu")
    p = _run("say", "--lines", "-d", str(tmp_path), *common, stdin=b"Hello world.\n\nGood morning!\n")
    assert p.returncode == 0, p.stderr.decode()
    names = p.stderr.decode().split()
    assert [Path(n).name for n in names] == ["line-0001.wav", "line-0002.wav"]
    lengths = [sf.info(n).frames for n in names]
    q = _run("say", "--lines", "--raw", *common, stdin=b"Hello world.\nGood morning!\n")
    assert q.returncode == 0
    assert len(q.stdout) == 2 * sum(lengths)


def test_lines_into_one_file_are_the_lines_files_end_to_end(tiny_dir, tmp_path):
    """--lines -o FILE: each line's segments decoded in one piece, as a file always is (`say LINE -o
    FILE`, the line's file with --dir), laid end to end (it got the streamed decode of stdout)."""
    common = ("--model", str(tiny_dir), "--greedy", "--device", "cpu")
    lines = b"Hello world.\nGood morning!\n"
    d = _run("say", "--lines", "-d", str(tmp_path / "d"), *common, stdin=lines)
    one = _run("say", "--lines", "-o", str(tmp_path / "all.wav"), *common, stdin=lines)
    assert d.returncode == 0 and one.returncode == 0, d.stderr.decode() + one.stderr.decode()
    each = [sf.read(n, dtype="int16")[0] for n in d.stderr.decode().split()]
    assert len(each) == 2
    np.testing.assert_array_equal(sf.read(tmp_path / "all.wav", dtype="int16")[0], np.concatenate(each))


def test_lines_in_a_batch_write_the_files_one_at_a_time_writes(tiny_dir, tmp_path):
    """--batch 3 generates the lines together (the longest of the last ones first): the same files,
    byte for byte, named in input order."""
    common = ("--model", str(tiny_dir), "--greedy", "--device", "cpu", "--local")
    lines = b"Hi.\nThe farmer watches from the old wooden porch.\nGood morning!\nOne.\n"
    one, many = tmp_path / "one", tmp_path / "many"
    for out, batch in ((one, "1"), (many, "3")):
        out.mkdir()
        p = _run("say", "--lines", "-d", str(out), "--batch", batch, *common, stdin=lines)
        assert p.returncode == 0, p.stderr.decode()
        assert [Path(n).name for n in p.stderr.decode().split()] == [f"line-000{k}.wav" for k in range(1, 5)]
    for k in range(1, 5):
        assert (many / f"line-000{k}.wav").read_bytes() == (one / f"line-000{k}.wav").read_bytes()


def _spawn(args):
    env = {**os.environ, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1"}
    # A child inherits ignored signals, and Python then installs no Ctrl-C handler: start it with
    # SIGINT at its default, whatever state earlier tests left this process in (in a full CI run
    # the child ignored SIGINT and finished normally).
    return subprocess.Popen([sys.executable, "-m", "minicpm_cli", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_interrupted_file_write_leaves_no_corrupt_file(tiny_dir, tmp_path, sig):
    text = tmp_path / "long.txt"
    text.write_text(long_text(2000))
    out = tmp_path / "out.wav"
    proc = _spawn(["say", "-f", str(text), "--model", str(tiny_dir), "--device", "cpu", "-o", str(out)])
    deadline = time.time() + 120
    while not list(tmp_path.glob(".out.wav.*.partial")) and time.time() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob(".out.wav.*.partial")), "the run never started writing"
    time.sleep(0.5)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert not out.exists()
    if sig != signal.SIGKILL:  # a caught signal also removes the temporary file, quietly
        assert not list(tmp_path.glob(".out.wav.*"))
        assert b"Traceback" not in err


def test_closed_pipe_ends_quietly(tiny_dir, tmp_path):
    text = tmp_path / "long.txt"
    text.write_text(long_text(600))
    proc = _spawn(["say", "-f", str(text), "--model", str(tiny_dir), "--device", "cpu", "-o", "-"])
    head = proc.stdout.read(1000)
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert len(head) == 1000
    assert proc.returncode == 0, err.decode()
    assert err == b"", err.decode()


def test_memory_does_not_grow_with_text_length(tiny_dir, tmp_path):
    """Peak RSS of reading 500 vs 2,000 words to a file: the audio is written as it comes. The read's
    LLM prompt holds the whole text up to the LLM's context, and its prefill's peak grows with it (the
    2,000 words' ~2,600 tokens cost ~35 MB more than 500 words' on the tiny model), so both prompts are
    cut to the same 512 tokens here: what is left to differ is the audio."""
    peaks, frames = [], []
    for words in (500, 2000):
        text = tmp_path / f"t{words}.txt"
        text.write_text(long_text(words))
        code = ("import resource, sys; from minicpm_cli.cli.app import main; sys.argv = sys.argv[1:]\n"
                "import minicpm_cli.engine.pipeline as pipeline; pipeline.LLM_CONTEXT = 512\n"
                "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)")
        env = {**os.environ, "PYTHONPATH": pythonpath()}
        p = subprocess.run([sys.executable, "-c", code, "minicpm", "say", "-f", str(text), "--model", str(tiny_dir),
                            "--device", "cpu", "--greedy", "-o", str(tmp_path / "o.wav")],
                           capture_output=True, env=env, timeout=600)
        assert p.returncode == 0, p.stderr.decode()
        peaks.append(int(re.findall(rb"\d+", p.stderr)[-1]))
        frames.append(sf.info(tmp_path / "o.wav").frames)
    assert frames[1] > 3 * frames[0], frames  # (the longer text made ~4x the audio)
    assert peaks[1] - peaks[0] < 40_000, peaks  # KiB


def test_text_longer_than_the_llm_context_keeps_its_beginning_in_the_prompt(synth):
    text = long_text(300)
    synth.llm_context = 200
    try:
        ids = synth.read_prompt_ids(text)
    finally:
        synth.llm_context = 4096
    assert len(ids) <= 200 and ids.count(synth.tokenizers.spk_id) == 1
    assert synth.tokenizers.llm.decode(ids).startswith("<|im_start|>user\nPlease read the text below.\nthe leaves")


# -- speed ---------------------------------------------------------------------------------------

SPEED_TEXT = "Good morning! Could you tell me the way to the library?"


@pytest.mark.parametrize("speed", [0.5, 1.5, 2.0])
def test_speed_changes_the_duration_not_the_codes(synth, speed):
    """At speed X the file and the stream last 1/X of speed 1's (within 3%; the same length both
    ways, as at speed 1), from the same codes; the stream's first chunk still leaves after the first
    generation call, all of it but the 4 context frames' span."""
    from minicpm_cli.engine.codec import samples_at

    base = list(synth.synthesize(SPEED_TEXT, Sampling(seed=2), decode="segment"))
    file = list(synth.synthesize(SPEED_TEXT, Sampling(seed=2), decode="segment", speed=speed))
    stream = list(synth.synthesize(SPEED_TEXT, Sampling(seed=2), decode="stream", speed=speed))
    codes = torch.cat([c.codes for c in base])
    for chunks in (file, stream):
        assert torch.equal(torch.cat([c.codes for c in chunks]), codes)
        n = sum(len(c.samples) for c in chunks)
        assert abs(n / (sum(len(c.samples) for c in base) / speed) - 1) < 0.03
        assert n == samples_at(synth.codec, len(codes), speed)
    assert len(stream[0].codes) == 25 and len(stream[0].samples) == samples_at(synth.codec, 21, speed)


def test_speed_one_is_todays_path(synth, monkeypatch):
    """speed=1.0, file and stream: bit for bit the audio of the call without it, and the file is the
    plain one-call decode of its codes (no resampling on the way)."""
    u = synth.say(SPEED_TEXT, Sampling(seed=3), speed=1.0)
    assert np.array_equal(u.audio, synth.say(SPEED_TEXT, Sampling(seed=3)).audio)
    assert np.array_equal(u.audio, synth.codec.decode(u.codes).numpy())
    import minicpm_cli.engine.codec as codec_module

    def no_stretch(*args, **kwargs):
        raise AssertionError("speed 1 resampled the mel")

    monkeypatch.setattr(codec_module, "stretch", no_stretch)
    at_one = [c.samples for c in synth.synthesize(SPEED_TEXT, Sampling(seed=3), speed=1.0)]
    plain = [c.samples for c in synth.synthesize(SPEED_TEXT, Sampling(seed=3))]
    assert len(at_one) == len(plain) and all(np.array_equal(a, b) for a, b in zip(at_one, plain))


def test_speed_over_segment_continuations(synth):
    """A text of several segments at speed 2: each segment's audio spans its own frames on the
    stretched grid (the carried-over context's audio dropped, as at speed 1)."""
    from minicpm_cli.engine.codec import samples_at

    chunks = list(synth.synthesize(long_text(260), Sampling(greedy=True), decode="segment", speed=2.0))
    by_segment = segments(chunks)
    assert len(by_segment) > 1
    for seg, cs in by_segment.items():
        frames = sum(len(c.codes) for c in cs)
        assert sum(len(c.samples) for c in cs) == samples_at(synth.codec, frames, 2.0), seg


def test_speed_out_of_range_is_a_usage_error(synth):
    from minicpm_cli.errors import UsageError

    for speed in (0.2, 4.5, float("nan")):
        with pytest.raises(UsageError, match="speed must be between 0.25 and 4"):
            next(synth.synthesize(SPEED_TEXT, speed=speed))
