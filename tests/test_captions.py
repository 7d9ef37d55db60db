"""Captions on the tiny checkpoint: `say`, `reply` and `bulk` write SRT/WebVTT files that parse back
(with the `srt` and `webvtt-py` packages, not our own code), whose cues are monotonic, carry the whole
text and end at the audio's length; the server's `timestamps` equal the command line's cues."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import pytest
import soundfile as sf

from minicpm_cli import captions
from minicpm_cli.captions import Cue, Timeline
from test_server import TINY, call, minicpm, served, sse_events  # noqa: F401  (served: the fixture)

srt = pytest.importorskip("srt")
webvtt = pytest.importorskip("webvtt")

TEXT = "Hello world. This is a test, with a clause. And a third sentence here!"
LOCAL = ("--local", "--model", str(TINY), "--device", "cpu", "--seed", "7")
RATE = 24000


@pytest.fixture(scope="module")
def spf(codec) -> int:
    return codec.samples_per_frame


def parsed(path: Path) -> list[tuple[float, float, str]]:
    """(start s, end s, text) of each cue, read by a library of its own."""
    if path.suffix == ".srt":
        return [(c.start.total_seconds(), c.end.total_seconds(), c.content) for c in srt.parse(path.read_text())]
    assert path.read_text().startswith("WEBVTT\n")
    return [(_secs(c.start), _secs(c.end), c.text) for c in webvtt.read(str(path))]


def _secs(stamp: str) -> float:
    h, m, s = stamp.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def check_cues(cues, seconds: float, spf: int, text: str) -> None:
    assert cues, "no cues"
    for (s0, e0, _), (s1, _, _) in zip(cues, cues[1:]):
        assert s0 < e0 <= s1
    assert cues[0][0] >= 0 and abs(cues[-1][1] - seconds) <= spf / RATE
    # (every character of the text, in order; a reply's cues may part inside a word)
    assert "".join("".join(t for _, _, t in cues).split()) == "".join(text.split())


def seconds_of(path_or_bytes) -> float:
    info = sf.info(io.BytesIO(path_or_bytes) if isinstance(path_or_bytes, bytes) else path_or_bytes)
    return info.frames / info.samplerate


# -- the cue computation ----------------------------------------------------------------------------


class C:  # a chunk as captions reads one
    def __init__(self, n, marks=(), final=False):
        self.samples, self.marks, self.final = range(n), tuple(marks), final


def test_timeline_rules():
    """A cue ends where the next starts; text at the same sample or of whitespace joins the cue before;
    a second utterance's marks count from where the first ended; the last cue ends at the length."""
    tl = Timeline()
    assert tl.add(C(100, [(0, "One. "), (0, "Two. ")])) == []
    assert tl.add(C(50, [(120, "  ")])) == []
    assert tl.add(C(30, [(140, "Three.")], final=True)) == [Cue(0, 140, "One. Two.")]
    assert tl.add(C(40, [(0, "Four")], final=True)) == [Cue(140, 180, "Three.")]
    assert tl.finish() == [Cue(180, 220, "Four")]
    assert tl.cues == [Cue(0, 140, "One. Two."), Cue(140, 180, "Three."), Cue(180, 220, "Four")]
    with pytest.raises(ValueError):
        captions.cues([C(10, [(5, "a"), (4, "b")])])


def test_render_formats():
    cues = [Cue(0, 12000, "A --> B"), Cue(12000, 24000 * 3661 + 12, "C")]
    assert captions.render(cues, "srt", RATE) == (
        "1\n00:00:00,000 --> 00:00:00,500\nA -> B\n\n2\n00:00:00,500 --> 01:01:01,001\nC\n")
    assert captions.render(cues, "vtt", RATE).startswith("WEBVTT\n\n1\n00:00:00.000 --> 00:00:00.500\n")


# -- the commands -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def said(tmp_path_factory):
    """`say` of TEXT to a file with SRT captions, and to stdout with VTT captions."""
    tmp = tmp_path_factory.mktemp("say")
    p = minicpm("say", TEXT, *LOCAL, "-o", str(tmp / "a.wav"), "--captions", str(tmp / "a.srt"))
    assert p.returncode == 0, p.stderr.decode()
    q = minicpm("say", TEXT, *LOCAL, "-o", "-", "--captions", str(tmp / "b.vtt"))
    assert q.returncode == 0, q.stderr.decode()
    return tmp, q.stdout


def test_say_to_a_file_and_to_stdout(said, spf):
    tmp, stdout = said
    check_cues(parsed(tmp / "a.srt"), seconds_of(tmp / "a.wav"), spf, TEXT)
    streamed = parsed(tmp / "b.vtt")
    check_cues(streamed, seconds_of(stdout), spf, TEXT)
    assert len(streamed) >= 2  # (one cue per text the TTS was given: more than one here)
    assert sorted(f.name for f in tmp.iterdir()) == ["a.srt", "a.wav", "b.vtt"]  # no temporary file left


def test_cues_follow_the_speed(said, tmp_path, spf):
    """At --speed 2 the cues are the same texts, each starting where its frame lands on the stretched
    audio (half as far in, to within a frame), the last ending at the (shorter) audio's length."""
    tmp, _ = said
    p = minicpm("say", TEXT, *LOCAL, "--speed", "2", "-o", str(tmp_path / "f.wav"), "--captions", str(tmp_path / "f.srt"))
    assert p.returncode == 0, p.stderr.decode()
    normal, fast = parsed(tmp / "a.srt"), parsed(tmp_path / "f.srt")
    check_cues(fast, seconds_of(tmp_path / "f.wav"), spf, TEXT)
    assert [t for _, _, t in fast] == [t for _, _, t in normal]
    for (s1, _, _), (s2, _, _) in zip(normal, fast):
        assert abs(s2 - s1 / 2) <= spf / RATE


def test_reply(tmp_path, spf):
    p = minicpm("reply", "Say something.", *LOCAL, "--max-tokens", "24", "-o", str(tmp_path / "r.wav"),
                "--text-out", str(tmp_path / "r.txt"), "--captions", str(tmp_path / "r.srt"))
    assert p.returncode == 0, p.stderr.decode()
    check_cues(parsed(tmp_path / "r.srt"), seconds_of(tmp_path / "r.wav"), spf, (tmp_path / "r.txt").read_text())


def test_bulk(tmp_path, spf):
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "text": TEXT}) + "\n"
                                       + json.dumps({"id": "b", "text": "Just one line, two clauses."}) + "\n")
    out = tmp_path / "out"
    p = minicpm("bulk", str(tmp_path / "in.jsonl"), "--out", str(out), "--model", str(TINY), "--device", "cpu",
                "--seed", "5", "--batch", "2", "--captions", "vtt")
    assert p.returncode == 0, p.stderr.decode()
    entries = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [e["captions"] for e in entries] == ["a.vtt", "b.vtt"]
    for e in entries:
        check_cues(parsed(out / e["captions"]), seconds_of(out / e["file"]), spf, e["text"])


@pytest.mark.parametrize("args", [("say", "Hi.", "-o"), ("reply", "Hi.", "-o")])
def test_bad_captions_name_is_a_usage_error(tmp_path, args):
    out = tmp_path / "x.wav"
    p = minicpm(*args, str(out), *LOCAL, "--captions", str(tmp_path / "x.txt"))
    err = [line for line in p.stderr.decode().splitlines() if line.strip()]
    assert p.returncode == 2 and len(err) == 1 and ".srt or .vtt" in err[0], p.stderr.decode()
    assert list(tmp_path.iterdir()) == []
    q = minicpm("bulk", str(tmp_path / "none.txt"), "--out", str(tmp_path / "o"), "--captions", "ass")
    assert q.returncode == 2 and "srt or vtt" in q.stderr.decode() and list(tmp_path.iterdir()) == []


# -- the server -------------------------------------------------------------------------------------


def as_srt(stamps: list[dict]) -> str:
    cues = [Cue(s["start_sample"], s["end_sample"], s["text"]) for s in stamps]
    for c, s in zip(cues, stamps):
        assert (s["start"], s["end"]) == (round(c.start / RATE, 6), round(c.end / RATE, 6))
    return captions.render(cues, "srt", RATE)


def test_server_timestamps_equal_the_command_line(served, said, tmp_path):
    tmp, _ = said
    body = {"input": TEXT, "seed": 7, "response_format": "wav", "timestamps": True}
    status, headers, data = call(served.url, "POST", "/v1/audio/speech", body)
    assert status == 200 and headers["content-type"] == "application/json", data[:300]
    answer = json.loads(data)
    assert base64.b64decode(answer["audio"]) == (tmp / "a.wav").read_bytes()
    assert answer["samples"] == sf.info(tmp / "a.wav").frames
    assert as_srt(answer["timestamps"]) == (tmp / "a.srt").read_text()

    status, _, data = call(served.url, "POST", "/v1/audio/speech", {**body, "stream_format": "sse"})
    assert status == 200
    events = [e for e in sse_events(data) if e["type"] == "speech.caption"]
    vtt = (tmp / "b.vtt").read_text()
    assert as_srt(events) == re.sub(r"(\d\d)\.(\d\d\d)", r"\1,\2", vtt.removeprefix("WEBVTT\n\n"))

    p = minicpm("reply", "Say something.", *LOCAL, "--max-tokens", "24", "-o", str(tmp_path / "r.wav"),
                "--captions", str(tmp_path / "r.srt"))
    assert p.returncode == 0, p.stderr.decode()
    status, _, data = call(served.url, "POST", "/v1/audio/reply",
                           {"input": "Say something.", "seed": 7, "max_tokens": 24, "timestamps": True})
    assert status == 200
    assert as_srt([e for e in sse_events(data) if e["type"] == "reply.caption"]) == (tmp_path / "r.srt").read_text()

    status, _, data = call(served.url, "POST", "/v1/audio/speech", {**body, "stream_format": "audio"})
    assert status == 400 and json.loads(data)["error"]["param"] == "timestamps"


def test_say_and_reply_captions_through_the_server_are_the_local_ones(served, said, tmp_path):
    """`--captions` with a server running: the server times the cues (the speech socket's, the reply
    stream's `timestamps`) and the files are the ones `--local` writes, audio and captions."""
    tmp, stdout = said
    remote = ("--server", served.url, "--seed", "7")
    p = minicpm("say", TEXT, *remote, "-o", str(tmp_path / "a.wav"), "--captions", str(tmp_path / "a.srt"))
    assert p.returncode == 0, p.stderr.decode()
    assert (tmp_path / "a.srt").read_text() == (tmp / "a.srt").read_text()
    assert (tmp_path / "a.wav").read_bytes() == (tmp / "a.wav").read_bytes()
    q = minicpm("say", TEXT, *remote, "-o", "-", "--captions", str(tmp_path / "b.vtt"))
    assert q.returncode == 0, q.stderr.decode()
    assert q.stdout == stdout and (tmp_path / "b.vtt").read_text() == (tmp / "b.vtt").read_text()
    # lines one after another in one stream: each a request, its cues laid after the ones before
    lines = b"First line here.\nAnd a second one, with a clause.\n"
    here = minicpm("say", "--lines", *LOCAL, "-o", "-", "--captions", str(tmp_path / "l.srt"), stdin=lines)
    there = minicpm("say", "--lines", *remote, "-o", "-", "--captions", str(tmp_path / "r.srt"), stdin=lines)
    assert here.returncode == there.returncode == 0, (here.stderr, there.stderr)
    assert there.stdout == here.stdout and (tmp_path / "r.srt").read_text() == (tmp_path / "l.srt").read_text()
    assert len(parsed(tmp_path / "r.srt")) >= 2
    reply = ("reply", "Say something.", "--max-tokens", "24", "-o")
    a = minicpm(*reply, str(tmp_path / "x.wav"), *LOCAL, "--captions", str(tmp_path / "x.srt"))
    b = minicpm(*reply, str(tmp_path / "y.wav"), *remote, "--captions", str(tmp_path / "y.srt"))
    assert a.returncode == b.returncode == 0, (a.stderr, b.stderr)
    assert (tmp_path / "y.srt").read_text() == (tmp_path / "x.srt").read_text()
    assert (tmp_path / "y.wav").read_bytes() == (tmp_path / "x.wav").read_bytes()


def test_a_caption_target_is_checked_as_every_output_file_is(tmp_path):
    """--captions FILE: its format, then files.check_target's checks (not a directory, a folder that
    exists and takes a new file), before any work."""
    from minicpm_cli import captions as cc
    from minicpm_cli.errors import UsageError

    assert cc.check_target(str(tmp_path / "a.srt")) == "srt"
    (tmp_path / "d.vtt").mkdir()
    with pytest.raises(UsageError, match="--captions .* is a directory"):
        cc.check_target(str(tmp_path / "d.vtt"))
    with pytest.raises(UsageError, match="output directory does not exist"):
        cc.check_target(str(tmp_path / "no" / "a.srt"))
