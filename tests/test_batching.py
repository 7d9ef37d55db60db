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

from minicpm_cli.engine.batching import LOOKAHEAD, Job, Stream, in_order, prompt_groups
from minicpm_cli.engine.llm import LLMSampling, next_token, next_tokens
from minicpm_cli.engine.pipeline import Synthesizer
from minicpm_cli.engine.sampling import Sampling, TokenNoise

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
    batched = list(in_order(synth.batch(), jobs, batch=ROWS))
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


def test_replies_and_reads_share_a_batch(synth, monkeypatch):
    """Replies decode their LLM tokens batched (decode_rows) and choose them together (next_tokens)
    while reads step the TTS alongside; prompts and TTS text chunks of a round prefill together, and
    their speaker vectors are projected together."""
    import minicpm_cli.engine.batching as batching

    sizes = {"prompts": [], "chunks": [], "choices": [], "starts": [], "lengths": [], "speakers": []}
    for name, obj, attr in (("prompts", synth.llm, "prefill_rows"), ("chunks", synth.tts, "prefill_rows"),
                            ("starts", synth.tts, "reset_rows"), ("lengths", synth.tts, "set_text_len_rows"),
                            ("speakers", synth.tts, "speakers")):
        fn = getattr(obj, attr)
        monkeypatch.setattr(obj, attr, lambda rows, *a, fn=fn, name=name: (sizes[name].append(len(rows)),
                                                                             fn(rows, *a))[1])
    choose = batching.next_tokens
    monkeypatch.setattr(batching, "next_tokens", lambda logits, *a: (sizes["choices"].append(len(logits)),
                                                                      choose(logits, *a))[1])
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
    batched = list(in_order(synth.batch(), jobs, batch=ROWS))
    for a, b in zip(alone, batched):
        _same(a, b)
    assert max(sizes["prompts"]) > 1 and max(sizes["chunks"]) > 1 and max(sizes["choices"]) > 1
    assert max(sizes["starts"]) > 1 and max(sizes["lengths"]) > 1 and max(sizes["speakers"]) > 1


def test_rows_start_together_as_each_alone(synth):
    """`reset_rows` and `set_text_len_rows` leave every row as `start_row` and `set_text_len_row`
    leave it, and the other rows as they were (runs of rows and rows apart): a started row's cache
    zeroed, [bos] its input, its next query at [Ptts]; each row's text slots visible as
    _build_streaming_mask(n) makes them."""
    tts = synth.tts
    rows, L = len(tts.positions), tts.L
    caches = [t for layer in tts.model.model.layers for t in (layer.self_attn.kv_cache.k, layer.self_attn.kv_cache.v)]

    def dirty():
        for t in caches:
            t.fill_(1.0)
        tts.bos_b.fill_(False)
        tts.vis_b[:, :L].fill_(-1)
        tts.positions[:] = [5] * rows

    def state():
        return [t.clone() for t in caches] + [tts.bos_b.clone(), tts.vis_b.clone(), torch.tensor(tts.positions)]

    def visible(n):  # [Stts], [spk_emb], n text tokens and [Etts]; [Ptts] and the [PAD]s never
        s = torch.arange(L)
        return torch.where((s <= n + 2) & (s < L - 1), tts._text_from, tts.never)

    kept = state()
    try:
        for started, lengths in (([0, 2], {0: 5, 1: 4, 2: 9}), ([1, 0], {0: 3, 1: 0})):
            dirty()
            for r, n in lengths.items():
                if r in started:
                    tts.start_row(r, n)
                else:
                    tts.set_text_len_row(r, n)
            alone = state()
            dirty()
            tts.reset_rows(started)
            tts.set_text_len_rows(list(lengths), list(lengths.values()))
            together = state()
            for a, b in zip(alone, together):
                assert torch.equal(a, b)
            for r in range(rows):
                assert all(bool((t[r] == (0 if r in started else 1)).all()) for t in caches)
                assert bool(tts.bos_b[r]) == (r in started)
                assert tts.positions[r] == (L - 1 if r in started else 5)
                want = visible(lengths[r]) if r in lengths else torch.full((L,), -1)
                assert torch.equal(tts.vis_b[r, :L].cpu(), want.to(tts.vis_b.dtype))
    finally:  # (the module's synthesizer, as it was)
        for t, k in zip(caches + [tts.bos_b, tts.vis_b], kept):
            t.copy_(k)
        tts.positions[:] = kept[-1].tolist()


def test_in_order_keeps_rows_busy_behind_a_long_job(synth):
    """A job that ended waits for the long one before it without holding its row: later jobs start."""
    log = []

    def job(k, text, forced, lane):
        log.append(("start", k))
        yield from _read(synth, text, Sampling(greedy=True), forced, "stream", lane)
        log.append(("end", k))

    texts = [(LONG, 1), ("One.", None), ("Good morning.", None), ("One.", None)]
    got = list(in_order(synth.batch(2), [functools.partial(job, k, *t) for k, t in enumerate(texts)], batch=2))
    assert len(got) == 4 and log.index(("start", 3)) < log.index(("end", 0))


def test_in_order_starts_the_last_jobs_longest_first(synth):
    """Once the input is all taken, the jobs left start by size, largest first; the outputs keep the
    input's order and equal the jobs run alone."""
    started = []

    def job(k, text, lane):
        started.append(k)
        return _read(synth, text, Sampling(greedy=True), None, "segment", lane)

    texts = ["One.", "Good morning, how are you today?", "Two.", "Good morning."]
    sizes = [1, 30, 2, 10]
    jobs = [Job(functools.partial(job, k, t), size) for k, (t, size) in enumerate(zip(texts, sizes))]
    got = list(in_order(synth.batch(2), jobs, batch=2))
    assert started == [1, 3, 2, 0]
    for text, chunks in zip(texts, got):
        assert [c.text for c in chunks][0] in text
        utt = synth.say(text, Sampling(greedy=True))
        torch.testing.assert_close(torch.cat([c.codes for c in chunks]), utt.codes, rtol=0, atol=0)


def test_in_order_reads_its_input_a_few_windows_ahead(synth):
    """Jobs start in input order while more input may come, with no more than LOOKAHEAD windows taken
    beyond those running; the last ones by size."""
    taken, started = [], []

    def start(k, lane):
        started.append((k, len(taken)))
        return iter(())

    def jobs():
        for k in range(12):
            taken.append(k)
            yield Job(functools.partial(start, k), size=k)

    assert len(list(in_order(synth.batch(2), jobs(), batch=2))) == 12
    assert started[0] == (0, (1 + LOOKAHEAD) * 2)
    assert [k for k, _ in started] == [0, 1, 2, 3, 4, 5, 6, 7, 11, 10, 9, 8]


def test_prompt_groups_pad_least():
    assert prompt_groups({3: 5}) == [[3]]
    assert prompt_groups({r: 40 + r for r in range(8)}) == [list(range(8))]  # alike: one forward
    mixed = {r: (60, 600)[r % 2] for r in range(6)}
    assert prompt_groups(mixed) == [[0, 2, 4], [1, 3, 5]]  # far apart: short ones not padded to 600
    assert prompt_groups(mixed, overhead=10**6) == [list(range(6))]


def test_next_tokens_chooses_each_row_as_next_token_alone():
    """Row by row what each stream chooses alone, over more choices than a block of draws holds."""
    torch.manual_seed(0)
    logits = torch.randn(4, 300) * 3
    windows = [[1, 2, 3], [5], [7, 7, 8, 9, 10], [299]]
    s = LLMSampling(temperature=0.7, top_k=20, repetition_penalty=1.3)

    def noises():
        return [None, TokenNoise(torch.Generator().manual_seed(1)), TokenNoise(torch.Generator().manual_seed(2)), None]

    steps = TokenNoise.BLOCK + 3
    batched, single = noises(), noises()
    together = [next_tokens(logits, windows, s, batched, banned=[4], vocab=290).tolist() for _ in range(steps)]
    alone = [[int(next_token(logits[i], windows[i], s, single[i], banned=[4], vocab=290)) for i in range(4)]
             for _ in range(steps)]
    assert together == alone
    assert len({t[1] for t in together}) > 1  # (the sampled rows draw, the greedy ones do not)
    assert len({t[0] for t in together}) == 1


def test_token_noise_draws_from_the_warped_distribution():
    """Exp(1) draws by rank give each candidate its probability after the warpers: three tokens with
    logits log(0.5), log(0.3), log(0.2), temperature 1, no top-k or top-p cut, 6,000 draws."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    s = LLMSampling(temperature=1.0, top_k=3, top_p=1.0, repetition_penalty=1.0)
    noise = TokenNoise(torch.Generator().manual_seed(0))
    got = torch.tensor([int(next_token(logits[0], [], s, noise)) for _ in range(6000)])
    freq = torch.bincount(got, minlength=3).float() / len(got)
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.025), freq


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
    batched = list(in_order(synth.batch(), reqs, batch=ROWS))
    for a, b in zip(alone, batched):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x.text == y.text
            torch.testing.assert_close(x.codes, y.codes, rtol=0, atol=0)
            np.testing.assert_allclose(x.samples, y.samples, rtol=0, atol=1e-4)


@pytest.mark.gpu
def test_batched_codec_decodes_each_row_as_alone(tiny_dir):
    """compile on CUDA: a round's codec decodes of one length run as one batched graph (rows padded to
    a power of two); each row's audio is its own decode's up to the rounding of cuDNN's batched convolutions
    (float32 audio in [-1, 1]; the codes are not touched)."""
    synth = Synthesizer.load(str(tiny_dir), device="cuda", dtype="float32", backend="compile", rows=ROWS)
    torch.manual_seed(0)
    codes = torch.randint(0, 600, (3, 29, synth.codec.num_vq), device="cuda")
    together = synth.codec.decode_batch(codes)
    for row, wav in zip(codes, together):
        torch.testing.assert_close(wav, synth.codec.decode(row), rtol=0, atol=3e-4)  # (H200: 9.4e-5 apart)


def test_speed_in_a_batch_is_the_single_streams(synth):
    """The batched engine gives each text, at speed 1.5, the audio it has alone (streamed and per
    segment), two streams running at once."""
    texts = ["Good morning to you.", "Could you tell me the way to the library, please?"]
    for decode in ("stream", "segment"):
        batched = list(synth.say_many([(t, Sampling(seed=i)) for i, t in enumerate(texts)], batch=2,
                                      decode=decode, speed=1.5))
        for i, (t, chunks) in enumerate(zip(texts, batched)):
            alone = list(synth.synthesize(t, Sampling(seed=i), decode=decode, speed=1.5))
            assert np.array_equal(np.concatenate([c.samples for c in chunks]),
                                  np.concatenate([c.samples for c in alone])), (decode, t)


def test_llm_tokens_wait_for_other_rows_without_changing_the_audio(synth, monkeypatch):
    """A stream that needs an LLM token while others run TTS steps waits up to `llm_defer` rounds for
    more rows to join its token step (a step reads the weights once for any rows): replies that
    arrived rounds apart take fewer token steps, and each one's audio is still its audio alone (only
    when a stream computes changes, not its order of work or of random draws)."""
    llm = LLMSampling(temperature=0.7)
    reqs = [("What is your name?", Sampling(seed=3)), ("Tell me about autumn.", Sampling(seed=11)),
            ("How are you?", Sampling(seed=5))]
    alone = [list(synth.reply(text, s, llm=llm, max_tokens=24)) for text, s in reqs]
    steps: list[int] = []
    decode_rows = synth.llm.decode_rows
    monkeypatch.setattr(synth.llm, "decode_rows",
                        lambda rows, ids: (steps.append(len(rows)), decode_rows(rows, ids))[1])
    counts = {}
    for defer in (0, 4):
        steps.clear()
        engine = synth.batch()
        engine.llm_defer = defer
        out: list[list] = [[] for _ in reqs]
        for k, (text, s) in enumerate(reqs):  # each arriving 7 rounds after the one before
            engine.submit(Stream(lambda lane, text=text, s=s: synth.reply(text, s, llm=llm, max_tokens=24, lane=lane),
                                 out[k].append))
            for _ in range(7):
                engine.round()
        engine.run()
        for a, b in zip(alone, out):
            _same(a, b)
        counts[defer] = len(steps)
    assert counts[4] < counts[0], counts
