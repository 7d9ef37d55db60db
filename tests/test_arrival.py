"""Text that is still arriving (a pipe): the rule that says when a part is ready to speak
(`text.arrival_cut`, `text.ready_parts`), `Synthesizer.synthesize_arriving`, and `minicpm say`
reading a slow writer's stdin."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from minicpm_cli.engine.sampling import Sampling
from minicpm_cli.engine.text import CLAUSE_TOKENS, READ_PIECE_TOKENS, arrival_cut, ready_parts

ROOT = Path(__file__).resolve().parents[1]
words = lambda t: len(t.split())  # noqa: E731  (a token count for the rule's unit tests)


@pytest.mark.parametrize("text, ready", [
    ("Hello there", ""),
    ("Hello there. And", "Hello there. "),
    ("Is it? Yes! Maybe", "Is it? Yes! "),
    ("Pi is 3.", ""),  # a Latin mark counts once the whitespace after it came: "3.5" is not cut
    ("Pi is 3.5 and", ""),
    ("Well, and", ""),  # a short clause waits for what follows it
    ("one two three four five six seven eight, nine", "one two three four five six seven eight, "),
    ("你好。世界", "你好。"),
])
def test_a_part_is_ready_at_a_sentence_or_a_long_clause(text, ready):
    assert CLAUSE_TOKENS == 8
    assert text[: arrival_cut(text, words)] == ready


def test_a_long_run_without_punctuation_is_cut_at_a_word():
    text = " ".join(f"w{i}" for i in range(READ_PIECE_TOKENS + 5))
    cut = arrival_cut(text, words)
    assert 0 < cut < len(text) and text[cut - 1] == " " and text[cut] == "w"
    assert text[cut:] == f"w{READ_PIECE_TOKENS + 4}"  # all but the word that may still be growing
    assert arrival_cut(" ".join(f"w{i}" for i in range(READ_PIECE_TOKENS)), words) == 0  # (at the bound: not yet)
    assert arrival_cut("x" * 400, len) == 400  # no word boundary at all: all of it


def test_parts_join_back_and_the_end_is_the_last():
    arrivals = [("Hi there. How", False), (" are you", False), ("?", False), (" Fine", False), ("", True)]
    parts = list(ready_parts(arrivals, words))
    assert parts == [("Hi there. ", False), ("How are you? ", False), ("Fine", True)]
    assert "".join(p for p, _ in parts) == "".join(t for t, _ in arrivals)
    assert list(ready_parts([("All of it. At once.", True)], words)) == [("All of it. At once.", True)]


def test_arriving_text_is_spoken_and_whole_text_is_synthesize(tiny_dir):
    from minicpm_cli.engine.pipeline import Synthesizer

    synth = Synthesizer.load(str(tiny_dir), device="cpu")
    text = "The first sentence is here. And then a second one follows it."
    whole = list(synth.synthesize(text, Sampling(greedy=True), decode="segment"))
    once = list(synth.synthesize_arriving([(text, True)], Sampling(greedy=True), decode="segment"))
    assert np.array_equal(np.concatenate([c.samples for c in once]), np.concatenate([c.samples for c in whole]))
    split = [("The first sentence ", False), ("is here. And then", False), (" a second one follows it.", True)]
    got = list(synth.synthesize_arriving(split, Sampling(greedy=True)))
    assert "".join(c.text for c in got).strip() == text
    assert sum(len(c.samples) for c in got) > 0 and got[-1].final
    # the first part ("... is here. ") came as its writer paused: it ended a segment, and the rest
    # ("And then a second one follows it.") continued it as the next
    assert got[-1].segment == 1
    first_segment = "".join(c.text for c in got if c.segment == 0)
    assert first_segment.strip() == "The first sentence is here."


def test_say_speaks_before_a_slow_writer_goes_on(tiny_dir):
    """The first sentence, then the writer waits: the first audio byte comes while it waits (the
    rest is written only once audio came, or after 120 s), and the stream holds the whole text's
    audio once stdin closes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    p = subprocess.Popen([sys.executable, "-m", "minicpm_cli", "say", "--local", "--model", str(tiny_dir), "--greedy",
                          "--device", "cpu", "-o", "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    first = threading.Event()
    out = bytearray()

    def read() -> None:
        while data := p.stdout.read1(1 << 16):
            out.extend(data)
            first.set()

    reader = threading.Thread(target=read)
    reader.start()
    p.stdin.write(b"The first sentence arrives alone.\n")
    p.stdin.flush()
    came = first.wait(120)
    p.stdin.write(b"Then the rest of it.\n")
    p.stdin.close()
    p.wait(120)
    reader.join(10)
    assert p.returncode == 0, p.stderr.read().decode()
    assert came, "no audio before the rest of the text was written"
    assert out[:4] == b"RIFF" and len(out) > 44
