"""Many streams on one loaded model at once: continuous batching of their generation steps.

A stream is one request's generation (a read or a reply: `Synthesizer.synthesize` or `reply` on a
`Lane`, its own row of the TTS and LLM KV caches). Each runs as a greenlet on the engine's thread, the
very code a single stream runs; where it would run a TTS generate() call, prefill a TTS text chunk,
decode audio, choose or decode one LLM token, project its speaker vector, start a TTS segment or set
its text's length, its lane hands the engine a request and waits. The engine runs rounds: admit
every waiting stream that has a free lane; resume the streams whose requests were answered (each runs
on until its next request), doing together, as often as they pile up, the round's TTS segment starts
and text lengths (`TTSRunner.reset_rows`, `set_text_len_rows`), speaker projections
(`TTSRunner.speakers`), TTS text prefills (`TTSRunner.prefill_rows`, one padded forward), codec
decodes (on CUDA, one batched call per length: `Codec.decode_batch`) and LLM
token choices (`llm.next_tokens`, row by row, one copy of all the chosen ids to the host); then the
LLM prompts waiting (in groups of similar length, `prompt_groups`, each one padded forward:
`LLMStage.prefill_rows`), one batched LLM token for every stream that asked for one
(`LLMStage.decode_rows`) and one batched TTS step for every open generate() call
(`TTSRunner.step_calls`). A stream joins the batch at the next step and leaves when it ends.

A stream may also wait for something from outside (text still arriving over a server's socket): its
lane's `park(ready)` parks it, holding its row, and each round resumes the parked streams whose
`ready()` has become true (or that were cancelled: `park` then raises `Cancelled`). A round computes
nothing for them meanwhile; `stalled` says when a round would compute nothing at all, so that the
engine's owner can sleep until something from outside happens instead of spinning.

A round's admissions stall the streams already playing by at most one group of prompts of up to
PROMPT_TOKENS (4096) padded tokens and one padded TTS prefill (about 0.1 s for 4096 tokens of the 7B
on an H100; a sentence's prompt is tens of milliseconds), against the 533 ms of audio that one
25-frame call gives every playing stream; the prompts past the bound wait for the next round.

Every stream keeps its own sampling generator, so a seeded request draws the same noise alone or
in a batch; the rows of a batched step are computed independently, so results differ from the
single-stream path only by the rounding of a different product shape (none in float32 on the CPU
tests, which check codes and samples; on CUDA the codec's batched convolutions round otherwise,
about 1e-4 of full scale, which is why the CPU decodes each stream alone). Nothing here knows HTTP
or files; greenlet is the only dependency (no threads: the CUDA state, graphs and torch's modes stay
on one thread).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import functools

import greenlet
import torch
from torch import Tensor

from .llm import LLMSampling, next_token, next_tokens
from .tts import Call, TTSLane


_START = object()
PROMPT_TOKENS = 4096  # padded LLM prompt tokens a round prefills at most (one group always)
HELD_BATCHES = 8  # in_order: jobs taken and not yet yielded, at most this many batches' worth
LOOKAHEAD = 2  # in_order: jobs taken ahead of those running, this many batches' worth at most
GROUP_OVERHEAD = 256  # a forward's cost beyond its tokens, in tokens (reading the weights once)
# rounds a stream's LLM token may wait for others to join its batched token step while TTS steps run
# (docs/design.md, "Many streams at once": a token step costs about seven TTS steps, whatever its rows)
LLM_DEFER = 4


class LLMLane:
    """Row `row` of an LLM stage with the stage's single-stream interface (reset, forward). Forwards
    of token ids go through `batcher` (row, ids) -> (logits, hidden) when an engine set one."""

    def __init__(self, stage, row: int):
        self.stage, self.row = stage, row
        self.batcher: Callable[[int, list[int]], tuple[Tensor, Tensor]] | None = None
        self.picker: Callable[[int, tuple], int] | None = None

    def reset(self) -> None:
        self.stage.reset_row(self.row)

    def forward(self, ids: list[int], embeds: Tensor | None = None,
                embed_at: list[int] | None = None) -> tuple[Tensor, Tensor]:
        if self.batcher is not None and embeds is None:
            return self.batcher(self.row, ids)
        return self.stage.forward_row(self.row, ids, embeds, embed_at)

    def pick(self, logits: Tensor, window: list[int], s: LLMSampling, noise, banned, vocab) -> int:
        """`llm.next_token`'s choice, on the host: with an engine, made together with the other
        streams' of the round that share its settings, and fetched with all of theirs in one copy
        (one wait for the device instead of one a stream)."""
        args = (logits, window, s, noise, banned, vocab)
        if self.picker is None:
            return int(next_token(*args))
        return self.picker(self.row, args)

    def save_prefix(self):
        return self.stage.save_prefix_row(self.row)

    def load_prefix(self, prefix) -> None:
        self.stage.load_prefix_row(self.row, prefix)


class CodecLane:
    """The synthesizer's codec as one stream of a batch sees it: its decodes go through `decoder`
    (row, codes) -> audio on the host, which runs those of a round together. A decode at another speed than 1
    runs alone, on the codec's eager halves, as the single stream runs it (`Codec.decode_at`), so a
    stream's audio at any speed is the one it has alone."""

    def __init__(self, codec, row: int, decoder: Callable[[int, Tensor], Tensor]):
        self.codec, self.row, self.decoder = codec, row, decoder
        self.num_vq, self.samples_per_frame, self.hop = codec.num_vq, codec.samples_per_frame, codec.hop

    @property
    def device(self) -> torch.device:
        return self.codec.device

    def decode(self, codes: Tensor) -> Tensor:
        return self.decoder(self.row, codes) if len(codes) else self.codec.decode(codes)

    def decode_at(self, codes: Tensor, speed: float, begin: int = 0) -> Tensor:
        return self.decode(codes) if speed == 1.0 else self.codec.decode_at(codes, speed, begin)


class Cancelled(Exception):
    """Raised in a parked stream that was cancelled while it waited (`Lane.park`)."""


@dataclass(frozen=True)
class Lane:
    """What one stream runs on: a row of the TTS runner, a row of the LLM stage and the codec; `park`
    (None outside an engine) waits until `ready()` is true, the other streams running meanwhile."""

    row: int
    tts: TTSLane
    llm: LLMLane
    codec: Any
    park: Callable[[Callable[[], bool]], None] | None = None


@dataclass(eq=False)
class Stream:
    """A submitted generation: `make(lane)` gives its iterator of items, each handed to `sink` as it
    is made; `done(error)` is called once at the end (error None when it completed or was cancelled)."""

    make: Callable[[Lane], Iterable]
    sink: Callable[[Any], None]
    done: Callable[[BaseException | None], None] = lambda error: None
    cancelled: bool = False
    lane: Lane | None = field(default=None, repr=False)

    def cancel(self) -> None:
        """Stop after the item being made (a stream not started yet never starts)."""
        self.cancelled = True


class Engine:
    """Runs streams on `synth` in batches of up to `rows` (the rows its TTS runner and LLM stage were
    loaded with). Not thread-safe: submit, cancel and run from the engine's thread."""

    def __init__(self, synth, rows: int | None = None):
        capacity = min(synth.tts.rows, getattr(synth.llm, "rows", 1))
        self.rows = capacity if rows is None else min(rows, capacity)
        if self.rows < 1:
            raise ValueError("a batch needs at least one row")
        self.synth = synth
        # decodes of a round batched on CUDA; on a CPU oneDNN's batched convolutions would round
        # otherwise than one stream's, so each stream decodes alone there
        batch_codec = synth.codec.device.type == "cuda"
        self.lanes = [Lane(b, synth.tts.lane(b), LLMLane(synth.llm, b),
                           CodecLane(synth.codec, b, self._decode_wait) if batch_codec else synth.codec,
                           functools.partial(self._park, b))
                      for b in range(self.rows)]
        for lane in self.lanes:
            lane.tts.batcher, lane.llm.batcher, lane.llm.picker = self._tts_wait, self._llm_wait, self._pick_wait
            lane.tts.prefiller, lane.tts.starter = self._prefill_wait, self._start_wait
            lane.tts.projector = self._project_wait
        self.free = list(range(self.rows))  # lowest first: batched steps run over rows 0..max
        self.queued: deque[Stream] = deque()
        self.ready: deque[tuple[greenlet.greenlet, Any]] = deque()
        self.tts_calls: dict[int, tuple[greenlet.greenlet, Call]] = {}
        self.llm_tokens: dict[int, tuple[greenlet.greenlet, int]] = {}
        self.llm_prompts: dict[int, tuple[greenlet.greenlet, list[int]]] = {}
        self.picks: dict[int, tuple[greenlet.greenlet, tuple]] = {}  # LLM tokens to choose (LLMLane.pick)
        self.tts_prefills: dict[int, tuple[greenlet.greenlet, tuple]] = {}  # (ids, begin, spk)
        self.tts_starts: dict[int, tuple[greenlet.greenlet, tuple[int, bool]]] = {}  # (n, reset): starts, lengths
        self.decodes: dict[int, tuple[greenlet.greenlet, Tensor]] = {}  # codes to decode
        self.projections: dict[int, tuple[greenlet.greenlet, Tensor]] = {}  # hidden states at <|spk|>
        self.parked: dict[int, tuple[greenlet.greenlet, Callable[[], bool]]] = {}  # waiting for ready()
        self.running: dict[int, Stream] = {}  # the stream on each row taken
        self.batch_prompts = hasattr(synth.llm, "prefill_rows")
        self.loop: greenlet.greenlet | None = None
        self.llm_defer = LLM_DEFER
        self.rounds = 0  # rounds run so far
        self.llm_since = 0  # the round in which the oldest waiting LLM token began to wait

    def submit(self, stream: Stream) -> Stream:
        self.queued.append(stream)
        return stream

    @property
    def idle(self) -> bool:
        return not (self.queued or self.running)

    @property
    def stalled(self) -> bool:
        """Whether a round would compute nothing: no stream to resume or waiting for a computation
        (a TTS call in progress included) but parked ones whose `ready()` is false, and no queued
        stream with a free row. Only something from outside ends that (what a parked stream waits
        for, a cancellation, a submission)."""
        waiting = (self.ready, self.tts_calls, self.llm_tokens, self.llm_prompts, self.picks, self.tts_starts,
                   self.tts_prefills, self.decodes, self.projections)
        return not (any(waiting) or (self.queued and self.free)) and not any(
            self.running[r].cancelled or ready() for r, (_, ready) in self.parked.items())

    def run(self) -> None:
        """Run rounds until every submitted stream has ended. Streams parked with nothing else left
        to run are cancelled: nothing here could give them what they wait for."""
        while not self.idle:
            if self.parked and self.stalled:
                for r in self.parked:
                    self.running[r].cancel()
            self.round()

    def round(self) -> None:
        """Admit, resume (with the round's TTS segment starts, speaker projections, text prefills, codec
        decodes and chosen tokens each done together), then the LLM prompts that are waiting (in one forward), one
        batched LLM token and one batched TTS step."""
        self.loop = greenlet.getcurrent()
        while self.queued and self.free:
            stream = self.queued.popleft()
            if stream.cancelled:
                stream.done(None)
                continue
            stream.lane = self.lanes[self.free.pop(0)]
            self.running[stream.lane.row] = stream
            self.ready.append((greenlet.greenlet(functools.partial(self._body, stream)), _START))
        for r, (g, ready) in list(self.parked.items()):
            if self.running[r].cancelled or ready():
                del self.parked[r]
                self.ready.append((g, None))
        while True:
            while self.ready:
                g, value = self.ready.popleft()
                g.parent = self.loop
                if value is _START:
                    g.switch()
                else:
                    g.switch(value)
            if not (self.picks or self.tts_starts or self.tts_prefills or self.decodes or self.projections):
                break
            with torch.inference_mode():
                if self.tts_starts:  # (first, alone: the streams started go on to their first prefill,
                    self._start_text()  # which then joins the others' in one forward)
                    continue
                if self.projections:
                    self._project()
                if self.picks:
                    self.pick_tokens()
                if self.tts_prefills:
                    self._prefill_text()
                if self.decodes:
                    self._decode()
        self.rounds += 1
        with torch.inference_mode():
            if self.llm_prompts:
                self._prefill_prompts()
            if self.llm_tokens and self._llm_due():
                rows = sorted(self.llm_tokens)
                logits, hidden = self.synth.llm.decode_rows(rows, [self.llm_tokens[r][1] for r in rows])
                for i, r in enumerate(rows):
                    self.ready.append((self.llm_tokens.pop(r)[0], (logits[i], hidden[i : i + 1])))
            if self.tts_calls:
                for call in self.synth.tts.step_calls([c for _, c in self.tts_calls.values()]):
                    self.ready.append((self.tts_calls.pop(call.row)[0], None))

    def _llm_due(self) -> bool:
        """Whether the waiting LLM tokens run this round. A token step reads the LLM's weights once
        for any number of rows, so a stream that needs one while others run TTS steps waits up to
        `llm_defer` rounds (TTS steps) for more to need theirs; at once when no TTS step would run
        (nothing to overlap: one stream, or all waiting for the LLM). Only when a stream computes
        changes, not what: its own order of work and of random draws stays as it was."""
        return not self.tts_calls or self.rounds - self.llm_since >= self.llm_defer

    def _prefill_prompts(self) -> None:
        """The waiting LLM prompts, in groups of similar length (`prompt_groups`), each one padded
        forward, as many groups (shortest first) as fit in PROMPT_TOKENS padded tokens (at least one);
        the rest wait for the next round."""
        llm, budget = self.synth.llm, PROMPT_TOKENS
        for i, group in enumerate(prompt_groups({r: len(p) for r, (_, p) in self.llm_prompts.items()})):
            cost = len(group) * max(len(self.llm_prompts[r][1]) for r in group)
            if i and cost > budget:
                break
            budget -= cost
            prompts = [self.llm_prompts[r][1] for r in group]
            # (one prompt alone: exactly the single-stream prefill)
            outs = llm.prefill_rows(group, prompts) if len(group) > 1 else [llm.forward_row(group[0], prompts[0])]
            # copies, two for the group: a backend's outputs are static buffers, which the next group's
            # forward of the same shape would overwrite before these streams resume
            logits = torch.stack([x for x, _ in outs])
            hidden = torch.cat([h for _, h in outs]).split([len(h) for _, h in outs])
            for i, r in enumerate(group):
                self.ready.append((self.llm_prompts.pop(r)[0], (logits[i], hidden[i])))

    def pick_tokens(self) -> None:
        """The LLM tokens the streams are choosing: one `next_tokens` for each group of the same
        settings, and all the chosen ids to the host in one copy."""
        groups: dict[tuple, list[int]] = {}
        for r, (_, (_, _, s, _, banned, vocab)) in sorted(self.picks.items()):
            groups.setdefault((s, tuple(banned or ()), vocab), []).append(r)
        rows, chosen = [], []
        for (s, banned, vocab), group in groups.items():
            args = [self.picks[r][1] for r in group]
            chosen.append(next_tokens(torch.stack([a[0] for a in args]), [a[1] for a in args], s,
                                      [a[3] for a in args], list(banned), vocab))
            rows += group
        for r, t in zip(rows, torch.cat(chosen).tolist()):
            self.ready.append((self.picks.pop(r)[0], t))

    def _start_text(self) -> None:
        """The waiting TTS segment starts (a row zeroed, its text length set) and text lengths, all
        together: a few launches for the round, where each stream's own took a few (0.2 ms a stream
        on an H200; 128 replies start in one round)."""
        starts = sorted((r, n, reset) for r, (_, (n, reset)) in self.tts_starts.items())
        tts = self.synth.tts
        tts.reset_rows([r for r, _, reset in starts if reset])
        tts.set_text_len_rows([r for r, _, _ in starts], [n for _, n, _ in starts])
        for r, _, _ in starts:
            self.ready.append((self.tts_starts.pop(r)[0], None))

    def _project(self) -> None:
        """The waiting speaker projections in one batch (`TTSRunner.speakers`)."""
        rows = sorted(self.projections)
        spks = self.synth.tts.speakers(torch.stack([self.projections[r][1] for r in rows]))
        for i, r in enumerate(rows):
            self.ready.append((self.projections.pop(r)[0], spks[i]))

    def _prefill_text(self) -> None:
        """The waiting TTS text prefills in one forward (one alone: the single-stream prefill)."""
        rows = sorted(self.tts_prefills)
        args = [self.tts_prefills[r][1] for r in rows]
        tts = self.synth.tts
        if len(rows) == 1:
            tts.prefill_row(rows[0], *args[0])
        else:
            tts.prefill_rows(rows, *(list(a) for a in zip(*args)))
        for r in rows:
            self.ready.append((self.tts_prefills.pop(r)[0], None))

    def _decode(self) -> None:
        """The waiting codec decodes, one batched call per length (one alone: the codec's own decode),
        each call's audio brought to the host in one copy: the streams stitch and hand on host audio
        (`StreamDecoder`), which would otherwise come over one stream at a time, each copy a wait for
        the device."""
        by_len: dict[int, list[int]] = {}
        for r, (_, codes) in self.decodes.items():
            by_len.setdefault(len(codes), []).append(r)
        codec = self.synth.codec
        for rows in by_len.values():
            if len(rows) == 1:
                out = codec.decode(self.decodes[rows[0]][1]).cpu()[None]
            else:
                out = codec.decode_batch(torch.stack([self.decodes[r][1] for r in rows])).cpu()
            for r, wav in zip(rows, out):
                self.ready.append((self.decodes.pop(r)[0], wav))

    def _body(self, stream: Stream) -> None:
        items, error = None, None
        try:
            items = iter(stream.make(stream.lane))
            for item in items:
                stream.sink(item)
                if stream.cancelled:
                    break
        except Cancelled:
            pass
        except BaseException as e:  # (handed to the stream's owner; the engine goes on)
            error = e
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()
            del self.running[stream.lane.row]
            self.free.append(stream.lane.row)
            self.free.sort()
        stream.done(error)

    def _park(self, row: int, ready: Callable[[], bool]) -> None:
        self.parked[row] = (greenlet.getcurrent(), ready)
        self.loop.switch()
        if self.running[row].cancelled:
            raise Cancelled

    def _tts_wait(self, call: Call) -> None:
        self.tts_calls[call.row] = (greenlet.getcurrent(), call)
        self.loop.switch()

    def _start_wait(self, row: int, n: int, reset: bool) -> None:
        self.tts_starts[row] = (greenlet.getcurrent(), (n, reset))
        self.loop.switch()

    def _prefill_wait(self, row: int, ids: list[int], begin: int, spk: Tensor | None) -> None:
        self.tts_prefills[row] = (greenlet.getcurrent(), (ids, begin, spk))
        self.loop.switch()

    def _project_wait(self, row: int, hidden: Tensor) -> Tensor:
        self.projections[row] = (greenlet.getcurrent(), hidden)
        return self.loop.switch()

    def _decode_wait(self, row: int, codes: Tensor) -> Tensor:
        self.decodes[row] = (greenlet.getcurrent(), codes)
        return self.loop.switch()

    def _pick_wait(self, row: int, args: tuple) -> int:
        self.picks[row] = (greenlet.getcurrent(), args)
        return self.loop.switch()

    def _llm_wait(self, row: int, ids: list[int]) -> tuple[Tensor, Tensor]:
        if len(ids) == 1:
            if not self.llm_tokens:
                self.llm_since = self.rounds + 1  # (this round's, counted once it computes)
            self.llm_tokens[row] = (greenlet.getcurrent(), ids[0])
        elif self.batch_prompts:
            self.llm_prompts[row] = (greenlet.getcurrent(), ids)
        else:
            return self.synth.llm.forward_row(row, ids)
        return self.loop.switch()


def prompt_groups(lengths: dict[int, int], overhead: int = GROUP_OVERHEAD) -> list[list[int]]:
    """Rows (keys) grouped by prompt length so that the padded tokens of all groups, plus `overhead`
    tokens' worth for each forward, are fewest (groups of consecutive lengths: a small dynamic
    program); shortest first, each group's rows in order."""
    rows = sorted(lengths, key=lambda r: (lengths[r], r))
    best, cut = [0] + [None] * len(rows), [0] * (len(rows) + 1)
    for i in range(1, len(rows) + 1):
        for j in range(i):
            cost = best[j] + (i - j) * lengths[rows[i - 1]] + overhead
            if best[i] is None or cost < best[i]:
                best[i], cut[i] = cost, j
    groups, i = [], len(rows)
    while i:
        groups.append(sorted(rows[cut[i] : i]))
        i = cut[i]
    return groups[::-1]


@dataclass(frozen=True)
class Job:
    """A job for `in_order`: `make(lane)` gives its items; `size` estimates how long it runs (a
    read's TTS text tokens), so that the last jobs can start longest first."""

    make: Callable[[Lane], Iterable]
    size: float = 0.0


def in_order(engine: Engine, jobs: Iterable[Callable[[Lane], Iterable] | Job], batch: int) -> Iterator[list]:
    """Run `jobs` (callables or `Job`s) with up to `batch` running at once; yield each job's items (a
    list) in submission order, as soon as it and every job before it have ended. A job's error is
    raised in its turn.

    Jobs are taken up to LOOKAHEAD batches beyond those running and start in order until the input
    is used up; then the rest start largest `size` first, so that the batch's end is not one long job
    running alone (256 bench lines at 128 rows: 1,284 TTS steps in input order, 812 so). Jobs that
    ended wait for those before them without holding a row, at most HELD_BATCHES batches' worth of
    jobs taken."""
    if batch < 1:
        raise ValueError("the batch must be at least 1")
    outputs: deque[tuple[list, list, Stream | None]] = deque()  # per job taken: (items, [ended, error], stream)
    jobs = iter(jobs)
    try:
        yield from _in_order(engine, jobs, batch, outputs)
    finally:  # stopped early (an error, or the consumer): cancel what is in flight and let it end
        for _, _, stream in outputs:
            if stream is not None:
                stream.cancel()
        engine.run()


def _in_order(engine, jobs, batch, outputs):
    pending: list[tuple[int, Job, list, list]] = []  # taken, not started: (taken as k-th, job, items, state)
    taken = running = 0
    exhausted = False
    while True:
        while (not exhausted and running + len(pending) < (1 + LOOKAHEAD) * batch
               and len(outputs) < HELD_BATCHES * batch):
            job = next(jobs, None)
            if job is None:
                exhausted = True
                break
            if not isinstance(job, Job):
                job = Job(job)
            items: list = []
            state: list = [False, None]
            outputs.append((items, state, None))
            pending.append((taken, job, items, state))
            taken += 1
        while pending and running < batch:
            # in order while more input may come; once it is all taken, the longest first
            i = max(range(len(pending)), key=lambda i: (pending[i][1].size, -i)) if exhausted else 0
            k, job, items, state = pending.pop(i)

            def done(error, state=state):
                nonlocal running
                state[0], state[1] = True, error
                running -= 1

            outputs[k - (taken - len(outputs))] = (items, state, engine.submit(Stream(job.make, items.append, done)))
            running += 1
        while outputs and outputs[0][1][0]:
            items, (_, error), _ = outputs.popleft()
            if error is not None:
                raise error
            yield items
        if exhausted and not outputs:
            return
        engine.round()
