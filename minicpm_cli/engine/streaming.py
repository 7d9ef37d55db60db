"""Streaming TTS over a stream of text pieces: the reference's `_generate_mel_spec_audio_streaming`.

Input: the speaker vector, the first text piece and an iterator of later pieces (LLM output for a
reply, sentences of a text for `say`). Output: events, in order: `Frames` (new audio codes of the
current segment, with the raw text read since the previous event), `SegmentEnd` (a segment that a
FLUSH ended has all its frames: its audio can be finished before the next piece is waited for) and
`NewSegment` (a continuation starts, seeded with frames carried over from the previous one). Audio
decoding is the caller's job.

Per segment (spec §4.5): each later piece is appended (number-normalised for replies), the text is
re-tokenised, and once it holds 10 more BERT tokens one text chunk is prefilled and 25 frames are
generated (at most one chunk per piece). When the pieces end without an audio EOS, the rest of the
text up to [Etts] is prefilled and frames are generated until EOS. Once the text reaches 120 tokens, a
piece that ends a sentence cuts the segment; the next segment starts from a fresh cache seeded with
the speaker vector, the last 5 text ids and the last 50 frames.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .text import BOUNDARY_END, Tokenizers
from .tts import FRAMES_PER_CALL, MAX_FRAMES, MIN_FRAMES_PER_CALL, TTSRunner

SEGMENT_CUT_TOKENS = 300 - 180  # the reference's streaming_text_reserved_len - shift_len
SEED_TEXT_IDS = 5
SEED_FRAMES = 50
TTS_EOS_TEXT = "<|tts_eos|>"
# Among a read's pieces (read_all): the text so far is all there is for now (a writer paused), so the
# segment ends at its EOS as a last one would; what comes later continues it as a new segment, seeded
# as a long text's next segment is.
FLUSH = "\x00flush"


@dataclass(frozen=True)
class Frames:
    codes: Tensor  # (k, num_vq) new frames, on the device
    text: str  # raw text read since the previous event


@dataclass(frozen=True)
class SegmentEnd:
    """The segment that a FLUSH ended has all its frames (what follows may be a while coming)."""


@dataclass(frozen=True)
class NewSegment:
    carried: Tensor  # (<=50, num_vq) frames the new segment starts from (already emitted before)


# --- text normalisation of streamed replies (the reference's NumberToTextConverter) ---------------

_DIGITS_EN = "zero one two three four five six seven eight nine".split()
_DIGITS_ZH = "零一二三四五六七八九"


def detect_language(text: str) -> str:
    zh = len(re.findall(r"[\u4e00-\u9fff]", text))
    en = len(re.findall(r"[a-zA-Z]", text))
    return "chinese" if zh >= en else "english"


def spell_numbers(text: str, language: str) -> str:
    """Every digit run spelled digit by digit, in place (first occurrence of each run, in order)."""
    for num in re.findall(r"\d+", text):
        if language == "chinese":
            words = "".join(_DIGITS_ZH[int(d)] for d in num)
        else:
            words = " ".join(_DIGITS_EN[int(d)] for d in num)
        text = text.replace(num, words, 1)
    return text


def sentence_end(piece: str) -> str:
    """The reference's sentence_end: the first of . 。 ! ? ！ ？ found in the piece (in that order);
    a first '.' that follows a digit does not count."""
    for c in (".", "。", "!", "?", "！", "？"):
        if c in piece:
            i = piece.find(c)
            if c == "." and i > 0 and piece[i - 1].isdigit():
                continue
            return c
    return ""


def reply_cut(piece: str, gen_text: str, n: int) -> int | None:
    """Where a reply segment is cut: after the last occurrence of the piece's sentence end."""
    c = sentence_end(piece)
    return gen_text.rfind(c) + 1 if c else None


FORCED_CUT_TOKENS = 240  # read-aloud pieces are <= 50 tokens, so a forced cut stays under 300


def read_cut(piece: str, gen_text: str, n: int) -> int | None:
    """For read-aloud text split by `text.read_pieces`: cut after a piece that ends a sentence or a
    clause; past FORCED_CUT_TOKENS after any piece, so no text is ever dropped for lack of room."""
    if BOUNDARY_END.search(piece) or n >= FORCED_CUT_TOKENS:
        return len(gen_text)
    return None


class _Peekable:
    def __init__(self, it: Iterator[str]):
        self.it, self.buf = iter(it), []

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return self.buf.pop() if self.buf else next(self.it)

    def has_more(self) -> bool:
        if not self.buf:
            try:
                self.buf.append(next(self.it))
            except StopIteration:
                return False
        return True


# --- the state machine --------------------------------------------------------------------------

class StreamingTTS:
    def __init__(self, runner: TTSRunner, tok: Tokenizers, spk: Tensor, generator: torch.Generator | None,
                 *, normalize: bool, cut: Callable[[str, str, int], int | None], read_all: bool = False,
                 first_chunk: int = FRAMES_PER_CALL, frames_per_token: int | None = None):
        self.runner, self.tok, self.spk, self.generator = runner, tok, spk, generator
        self.normalize, self.cut, self.read_all = normalize, cut, read_all
        if not 1 <= first_chunk <= FRAMES_PER_CALL:
            raise ValueError(f"first_chunk must be 1..{FRAMES_PER_CALL} frames")
        self.first_chunk = first_chunk
        # Benchmarks with random weights force the length: EOS is never sampled, and a segment ends
        # after exactly frames_per_token frames per text token, so runs compare.
        self.frames_per_token = frames_per_token
        self.calls = 0
        c = runner.config
        self.chunk = c.streaming_text_chunk_size
        self.reserved = c.streaming_text_reserved_len

    def run(self, first_text: str, pieces: Iterator[str]) -> Iterator[Frames | SegmentEnd | NewSegment]:
        pieces = _Peekable(pieces)
        seed = None
        while True:
            seed = yield from self._segment(first_text if seed is None else None, pieces, seed)
            if seed is None:
                return

    def _generate(self, text: str, steps: int = FRAMES_PER_CALL):
        """One reference generate() call as Frames events; returns (codes, ended in EOS). The very
        first call may be split so that its first frames reach the decoder sooner: the EOS rules
        count steps across the split, so the codes are the same."""
        r, g, eos = self.runner, self.generator, self.frames_per_token is None
        first = self.calls == 0
        self.calls += 1
        if first and self.first_chunk < steps:
            codes, finished = r.generate(g, self.first_chunk, MIN_FRAMES_PER_CALL, eos)
            yield Frames(codes, text)
            if finished:
                return codes, True
            rest, finished = r.generate(g, steps - self.first_chunk,
                                        max(MIN_FRAMES_PER_CALL - self.first_chunk, 0), eos)
            yield Frames(rest, "")
            return torch.cat([codes, rest]), finished
        codes, finished = r.generate(g, steps, MIN_FRAMES_PER_CALL, eos)
        yield Frames(codes, text)
        return codes, finished

    def _segment(self, first_text: str | None, pieces: Iterator[str], seed):
        r, tok = self.runner, self.tok
        chunk_idx = 0
        codes: list[Tensor] = []
        last_ids: list[int] | None = None  # tokenisation used by the latest prefill
        cond = None
        if seed is None:
            gen_text = first_text.split(TTS_EOS_TEXT)[0]
            cond = tok.condition(gen_text, self.reserved)
            r.start(cond.n)
            gen_raw, emitted = gen_text, 0
        else:
            seed_ids, carried, text_left = seed
            r.start(len(seed_ids))
            r.prefill([tok.stts, tok.spk_emb] + seed_ids, 0, self.spk)
            r.prefill_audio(carried)
            codes.append(carried)
            chunk_idx = len(seed_ids) // self.chunk
            gen_text = tok.bert.decode(seed_ids) + text_left
            gen_raw, emitted = gen_text, len(gen_text)
            if self.read_all:  # the carried-over text is read even if no piece follows
                cond = tok.condition(gen_text, self.reserved)
            yield NewSegment(carried)
        lang = None
        new_segment = finished = flushed = False
        text_left = ""
        pending = seed is not None and bool(seed[2].strip())  # text carried over, not yet spoken
        t = 0
        for piece in pieces:
            if piece is FLUSH:
                if t == 0 and not pending:
                    continue  # (nothing in this segment to end yet)
                new_segment = flushed = True
                break
            t += 1
            txt = piece.split(TTS_EOS_TEXT)[0]
            gen_raw += txt
            if t == 1 and txt == "" and seed is not None:
                return None
            if self.normalize:
                if t <= 2:
                    lang = detect_language(gen_raw)
                txt_norm = spell_numbers(txt, lang).replace("*", "")
            else:
                txt_norm = txt
            gen_text += txt_norm
            cond = tok.condition(gen_text, self.reserved)
            if cond.n >= SEGMENT_CUT_TOKENS:
                at = self.cut(txt, gen_text, cond.n)
                if at:
                    gen_text, text_left = gen_text[:at], gen_text[at:]
                    cond = tok.condition(gen_text, self.reserved)
                    new_segment = True
                    break
            if cond.n >= (chunk_idx + 1) * self.chunk:
                begin = 0 if chunk_idx == 0 else chunk_idx * self.chunk + 2
                end = min((chunk_idx + 1) * self.chunk + 2, r.L - 1)
                r.prefill(cond.ids[begin:end], begin, self.spk if chunk_idx == 0 else None)
                last_ids = cond.ids
                r.set_text_len(cond.n)
                new, finished = yield from self._generate(gen_raw[emitted:])
                emitted = len(gen_raw)
                chunk_idx += 1
                codes.append(new)
                if finished:
                    break
        if cond is None:  # a continuation whose pieces had already run out
            return None
        stop = False
        end = cond.n + 3  # through [Etts]
        if not finished:
            begin = 0 if chunk_idx == 0 else chunk_idx * self.chunk + 2
            if end > begin:
                r.prefill(cond.ids[begin:end], begin, self.spk if chunk_idx == 0 else None)
                last_ids = cond.ids
                r.set_text_len(cond.n)
            target = None if self.frames_per_token is None else self.frames_per_token * cond.n
            made = sum(len(c) for c in codes)
            while target is None or made < target:
                steps = FRAMES_PER_CALL if target is None else min(FRAMES_PER_CALL, target - made)
                new, finished = yield from self._generate(gen_raw[emitted:], steps)
                emitted = len(gen_raw)
                codes.append(new)
                made += len(new)
                if finished:
                    break
                if made > MAX_FRAMES:
                    stop = True
                    break
        if not codes:  # nothing was generated (an empty text with forced lengths): nothing to carry
            return None
        carried = torch.cat(codes)[-SEED_FRAMES:]
        if self.read_all:
            if flushed:  # (its audio goes out now, not once the text that continues it has come)
                yield SegmentEnd()
            return self._read_on(cond, gen_text, text_left, carried, pieces, new_segment)
        if not new_segment or stop:
            return None
        seed_ids = (last_ids or cond.ids)[end - 1 - SEED_TEXT_IDS : end - 1]
        return seed_ids, carried, text_left

    def _read_on(self, cond, gen_text: str, text_left: str, carried: Tensor, pieces: "_Peekable", cut: bool):
        """Read-aloud never drops text between segments: when a segment ends (EOS, frame cap or a
        cut) while text remains, the next segment starts right after the text its last frame could
        see, seeded like a reference continuation. The last segment ends as the reference's read path
        does, at its EOS. (A reply instead ends at the first EOS and drops the rest of the LLM text,
        as the reference does.)"""
        if not cut and not pieces.has_more():
            return None
        covered = min(self.runner.visible_text(self.runner.pos - 1), cond.n)
        offsets = self.tok.bert_offsets(gen_text)
        at = offsets[covered - 1][1] if covered else 0
        left = gen_text[at:] + text_left
        if not left.strip() and not pieces.has_more():
            return None
        seed_ids = cond.ids[2 + max(covered - SEED_TEXT_IDS, 0) : 2 + covered]
        return seed_ids, carried, left
