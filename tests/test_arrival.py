"""Text that is still arriving (a pipe): the rule that says when a part is ready to speak
(`text.arrival_cut`, `text.ready_parts`), `Synthesizer.synthesize_arriving`, and `minicpm say`
reading a slow writer's stdin."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest
from conftest import pythonpath, slow_writer

from minicpm_cli.engine.sampling import Sampling
from minicpm_cli.engine.inbox import Closed, Inbox
from minicpm_cli.engine.text import CLAUSE_TOKENS, READ_PIECE_TOKENS, Arrival, arrival_cut, ready_parts

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


def test_a_flush_makes_what_is_pending_a_part():
    arrivals = [Arrival("Hello there"), Arrival("", flush=True), Arrival(" "), Arrival("", flush=True),
                Arrival("and more", ended=True)]
    assert list(ready_parts(arrivals, words)) == [("Hello there", False), (" and more", True)]


def test_an_inbox_gives_its_messages_as_they_come_until_the_end_or_its_close():
    def reading(inbox: Inbox) -> tuple[threading.Thread, list]:
        got: list = []

        def read() -> None:
            try:
                got.extend(inbox.arrivals())  # (no park: this thread waits)
            except Closed:
                got.append("closed")

        thread = threading.Thread(target=read)
        thread.start()
        return thread, got

    woken = []
    inbox = Inbox(wake=lambda: woken.append(1))
    reader, got = reading(inbox)
    inbox.put("One. ")
    inbox.put("Two", flush=True)
    inbox.put("", ended=True)
    reader.join(10)
    assert got == [Arrival("One. "), Arrival("Two", flush=True), Arrival("", ended=True)] and len(woken) == 3
    assert inbox.received == "One. Two"
    inbox = Inbox()
    reader, got = reading(inbox)
    inbox.put("Half a sent")
    inbox.close()
    reader.join(10)
    assert got in ([Arrival("Half a sent"), "closed"], ["closed"])


@pytest.fixture(scope="module")
def synth(tiny_dir):
    from minicpm_cli.engine.pipeline import Synthesizer

    return Synthesizer.load(str(tiny_dir), device="cpu")


def test_arriving_text_is_spoken_and_whole_text_is_synthesize(synth):
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


def test_a_parts_audio_is_all_out_before_more_text_is_waited_for(synth):
    """A part ends its segment (it came as its writer paused): the segment's last chunk, the crossfade's
    tail included, is yielded before the next arrival is asked for (a server's client, an agent, hears
    all of what it sent while it thinks of more)."""
    got, asked = [], []

    def arrivals():
        yield "The first sentence is here. ", False
        asked.append(list(got))
        yield "And more.", True

    for chunk in synth.synthesize_arriving(arrivals(), Sampling(greedy=True)):
        got.append(chunk)
    (before,) = asked
    assert before and before[-1].ends_segment and before[-1].segment == 0 and len(before[-1].samples)
    assert not any(c.segment for c in before) and got[len(before)].segment == 1 and got[-1].final
    assert [c.ends_segment for c in got].count(True) == 2


def test_say_speaks_before_a_slow_writer_goes_on(tiny_dir):
    """The first sentence, then the writer waits: the first audio byte comes while it waits (the
    rest is written only once audio came, or after 120 s), and the stream holds the whole text's
    audio once stdin closes."""
    env = {**os.environ, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1"}
    code, err, came, out = slow_writer([sys.executable, "-m", "minicpm_cli", "say", "--local", "--model", str(tiny_dir),
                                        "--greedy", "--device", "cpu", "-o", "-"], env)
    assert code == 0, err.decode()
    assert came, "no audio before the rest of the text was written"
    assert out[:4] == b"RIFF" and len(out) > 44
