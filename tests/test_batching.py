"""Batched generation: every stream of a batch gives what it gives alone (tiny checkpoint, float32, CPU).

The requests differ in text and length, join and leave the batch at different steps (more requests
than rows, so later ones take the rows of finished ones), one of them reads on into a continuation
segment, and greedy and seeded requests share batches. Codes must be equal and samples equal within
float32 rounding of a different product shape.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from minicpm_cli.batching import Stream, in_order
from minicpm_cli.llm import LLMSampling
from minicpm_cli.pipeline import Synthesizer
from minicpm_cli.sampling import Sampling

ROWS = 3
# (text, sampling, frames per text token or None): short texts whose random-weight speech ends soon,
# and a long one read at a forced length (one frame a token, so it stays short) that needs a
# continuation segment
LONG = " ".join(["Autumn leaves turn red and gold when the nights grow cold, and birds fly south."] * 9)
READS = [
    ("Hi, how are you?", Sampling(greedy=True), None),
    ("Good morning.", Sampling(seed=101), None),
    (LONG, Sampling(seed=7), 1),
    ("One.", Sampling(greedy=True), None),
    ("Good morning.", Sampling(greedy=True), None),
]


@pytest.fixture(scope="module")
def synth(tiny_dir):
    return Synthesizer.load(str(tiny_dir), device="cpu", dtype="float32", backend="eager", rows=ROWS)


def _read(synth, text, sampling, forced, decode, lane=None):
    return synth.synthesize(text, sampling, decode=decode, frames_per_token=forced, lane=lane)


def _same(alone, batched):
    assert len(alone) == len(batched)
    for a, b in zip(alone, batched):
        assert (a.text, a.segment, a.final) == (b.text, b.segment, b.final)
        torch.testing.assert_close(a.codes, b.codes, rtol=0, atol=0)
        np.testing.assert_allclose(a.samples, b.samples, rtol=0, atol=1e-5)


@pytest.mark.parametrize("decode", ["segment", "stream"])
def test_reads_in_a_batch_equal_reads_alone(synth, decode):
    alone = [list(_read(synth, *r, decode)) for r in READS]
    assert max(c.segment for c in alone[2]) >= 1  # the continuation is exercised
    jobs = [functools.partial(_read, synth, *r, decode) for r in READS]
    batched = list(in_order(synth.batch(), jobs, window=ROWS))
    for a, b in zip(alone, batched):
        _same(a, b)


def test_say_many_keeps_input_order_and_equals_say(synth):
    items = [(t, s) for t, s, forced in READS if forced is None]
    got = list(synth.say_many(items, batch=2))
    assert len(got) == len(items)
    for (text, sampling), chunks in zip(items, got):
        utt = synth.say(text, sampling)
        torch.testing.assert_close(torch.cat([c.codes for c in chunks]), utt.codes, rtol=0, atol=0)
        np.testing.assert_allclose(np.concatenate([c.samples for c in chunks]), utt.audio, rtol=0, atol=1e-5)


def test_replies_and_reads_share_a_batch(synth):
    """Replies decode their LLM tokens batched (decode_rows) while reads step the TTS alongside."""
    llm = LLMSampling(temperature=0.7)
    reqs = [("reply", "What is your name?", Sampling(greedy=True)),
            ("read", "Good morning.", Sampling(seed=101)),
            ("reply", "Tell me about autumn.", Sampling(seed=11)),
            ("reply", "How are you?", Sampling(seed=5))]

    def run(kind, text, sampling, lane=None):
        if kind == "reply":
            return synth.reply(text, sampling, llm=llm, max_tokens=24, lane=lane)
        return synth.synthesize(text, sampling, lane=lane)

    alone = [list(run(*r)) for r in reqs]
    jobs = [functools.partial(lambda r, lane: run(*r, lane=lane), r) for r in reqs]
    batched = list(in_order(synth.batch(), jobs, window=ROWS))
    for a, b in zip(alone, batched):
        _same(a, b)


def test_a_cancelled_stream_frees_its_row_and_leaves_the_others_alone(synth):
    engine = synth.batch()
    text = "Hi, how are you?"
    alone = list(synth.synthesize(text, Sampling(greedy=True), decode="stream"))
    got, cut = [], []
    keep = engine.submit(Stream(lambda lane: synth.synthesize(text, Sampling(greedy=True), decode="stream", lane=lane),
                                got.append))
    stop = engine.submit(Stream(lambda lane: synth.synthesize(text, Sampling(seed=1), decode="stream", lane=lane),
                                lambda c: (cut.append(c), stop.cancel())))
    engine.run()
    assert len(cut) == 1 and keep.lane.row == 0 and stop.lane.row == 1
    _same(alone, got)
    assert engine.free == list(range(engine.rows)) and engine.idle


def test_an_error_in_one_stream_reaches_its_owner_only(synth):
    engine = synth.batch()
    errors, good = [], []
    engine.submit(Stream(lambda lane: synth.synthesize("   ", Sampling(greedy=True), lane=lane), good.append,
                         errors.append))
    engine.submit(Stream(lambda lane: synth.synthesize("One.", Sampling(greedy=True), lane=lane), good.append))
    engine.run()
    assert [type(e).__name__ for e in errors] == ["UsageError"]
    assert good and good[-1].final


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_cuda_graphs_equal_the_single_stream_path(tiny_dir, dtype):
    """compile on CUDA: row 0 alone steps on the Triton kernels, TTS batches on their batched versions
    row by row (backends/kernels/batch.py, the runner's `batch_kernels="rows"`) in a CUDA graph per
    batch size; the codes are the same, in bfloat16 too (cuBLAS's batched products rounded
    differently). The LLM's batched tokens still run on cuBLAS, so replies are compared in float32
    only. (The runner's default tensor-core batches differ from the single step by rounding:
    tests/test_batch_kernels.py checks that their rows do not depend on the batch.)"""
    from minicpm_cli.backends.kernels.batch import BatchDecode

    synth = Synthesizer.load(str(tiny_dir), device="cuda", dtype=dtype, backend="compile", rows=ROWS)
    synth.tts.batch, synth.tts.batch_kernels = BatchDecode(synth.tts.triton), "rows"
    llm = LLMSampling(temperature=0.7)
    reqs = [lambda lane, r=r: _read(synth, *r, "stream", lane) for r in READS]
    if dtype == "float32":
        reqs.append(lambda lane: synth.reply("What is your name?", Sampling(seed=2), llm=llm, max_tokens=12,
                                             lane=lane))
    alone = [list(make(None)) for make in reqs]
    batched = list(in_order(synth.batch(), reqs, window=ROWS))
    for a, b in zip(alone, batched):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x.text == y.text
            torch.testing.assert_close(x.codes, y.codes, rtol=0, atol=0)
            np.testing.assert_allclose(x.samples, y.samples, rtol=0, atol=1e-4)
