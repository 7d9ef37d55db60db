"""Tokenizers, prompts and the TTS condition layout.

The LLM tokenizer (Qwen2 byte-level BPE) and the ChatTTS BERT tokenizer are loaded from the
checkpoint's files; every special-token id is looked up in them, never hard-coded, because the ids
differ between checkpoints. This module knows strings and ids, nothing about tensors or models.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ..errors import CheckpointError

READ_INSTRUCTION = "Please read the text below."
ASSISTANT_TTS_PREFIX = "<|im_start|>assistant\n<|spk_bos|><|spk|><|spk_eos|><|tts_bos|>"
# The voice prompts of the early-2025 revision of the reference (the parity goldens' strings); a later
# revision reads "Use the voice in the audio prompt to synthesize new content." / "You are a helpful
# assistant with the above voice style." (spec §0.1, §4.4).
VOICE_CLONE_INSTRUCTION = "Clone the voice in the provided audio prompt."
VOICE_ASSISTANT_STYLE = "As an assistant, you will speak using this voice style."
AUDIO_START, AUDIO_END, AUDIO_SLOT = "<|audio_start|>", "<|audio_end|>", "<unk>"


# A run of sentence/clause punctuation (and closing quotes/brackets) followed by space or the end;
# CJK full-width punctuation needs no space after it.
_CLOSERS = r"[\"')\]\u201d\u2019\u00bb]*"  # quotes and brackets that close with the mark before them
_PUNCT = rf"[.!?;:,\u2026]+{_CLOSERS}"
_CJK_PUNCT = r"[\u3002\uff01\uff1f\uff1b\uff1a\uff0c]+"
_BOUNDARY = re.compile(rf"{_PUNCT}(?:\s+|$)|{_CJK_PUNCT}\s*")
BOUNDARY_END = re.compile(rf"(?:{_PUNCT}|{_CJK_PUNCT})\s*$")
READ_PIECE_TOKENS = 50


def read_pieces(text: str, count: Callable[[str], int], max_tokens: int = READ_PIECE_TOKENS) -> list[str]:
    """Split text into pieces at sentence and clause ends, keeping every character (the pieces join
    back to the text). A piece of more than `max_tokens` (by `count`) is split further between words,
    or between characters where there are no spaces."""
    pieces, start = [], 0
    for m in _BOUNDARY.finditer(text):
        pieces.append(text[start : m.end()])
        start = m.end()
    if start < len(text):
        pieces.append(text[start:])
    out: list[str] = []
    for piece in pieces:
        if count(piece) <= max_tokens:
            out.append(piece)
            continue
        acc = ""
        for word in re.findall(r"\S+\s*|\s+", piece):
            units = [word] if count(word) <= max_tokens else list(word)
            for u in units:
                if acc and count(acc + u) > max_tokens:
                    out.append(acc)
                    acc = ""
                acc += u
        if acc:
            out.append(acc)
    return out


# Text arriving (a pipe, a socket) is spoken from the first part ready: up to its last sentence end
# (.!? and their CJK forms); up to its last clause end (,;:) once that part holds CLAUSE_TOKENS TTS
# tokens (a clause of a word or two is better read with what follows it); up to its last word boundary
# once READ_PIECE_TOKENS have come without either (a long run without punctuation). A Latin mark
# counts once the whitespace after it has arrived, so "3.5" or "e.g" arriving in two writes is not cut.
_SENTENCE_END = re.compile(rf"[.!?\u2026]+{_CLOSERS}\s+|[\u3002\uff01\uff1f]+\s*")
_CLAUSE_END = re.compile(rf"{_PUNCT}\s+|{_CJK_PUNCT}\s*")
CLAUSE_TOKENS = 8


def arrival_cut(text: str, count: Callable[[str], int], max_tokens: int = READ_PIECE_TOKENS,
                clause_tokens: int = CLAUSE_TOKENS) -> int:
    """How many leading characters of `text` (what has arrived and is not yet spoken) are ready to be
    spoken now, by the rule above; 0 while none are. The cut keeps the whitespace after it, so the
    parts join back to the text."""
    ends = [m.end() for m in _SENTENCE_END.finditer(text)]
    if ends:
        return ends[-1]
    ends = [m.end() for m in _CLAUSE_END.finditer(text)]
    if ends and count(text[: ends[-1]]) >= clause_tokens:
        return ends[-1]
    if count(text) > max_tokens:
        spaces = [m.end() for m in re.finditer(r"\s+", text) if m.start() > 0]
        return spaces[-1] if spaces else len(text)
    return 0


class Arrival(NamedTuple):
    """Text as it arrived (a pipe, a socket): all that could be read at once, whether the input ended
    right after it, and whether its writer asked that all pending text be spoken now (a server's
    `flush`). A plain (text, ended) pair is an arrival without a flush."""

    text: str
    ended: bool = False
    flush: bool = False


def ready_parts(arrivals: Iterable[tuple[str, bool] | Arrival],
                count: Callable[[str], int]) -> Iterator[tuple[str, bool]]:
    """Arrivals (`Arrival`s, or (text, ended) pairs) -> (part, last) in order, each part ready by
    `arrival_cut`, or all that is pending where an arrival asks for a flush (unless it is only
    whitespace); the text left at the end is the last part. The parts join back to the input. A first
    part that is also the last is the whole text given at once."""
    buf = ""
    for item in arrivals:
        text, ended, flushed = Arrival(*item)
        buf += text
        if ended:
            break
        cut = len(buf) if flushed and buf.strip() else arrival_cut(buf, count)
        if cut:
            yield buf[:cut], False
            buf = buf[cut:]
    yield buf, True


def read_prompt(text: str) -> str:
    """The prompt of the reference's read-aloud path (chat() with the TTS template, no system turn)."""
    return f"<|im_start|>user\n{READ_INSTRUCTION}\n{text}<|im_end|>\n{ASSISTANT_TTS_PREFIX}"


def audio_placeholder(groups: list[int]) -> str:
    """The reference processor's text for chunked audio: per group (one second of audio) its start
    token, one <unk> per audio embedding, its end token. The embeddings replace the <unk>s in order."""
    return "".join(AUDIO_START + AUDIO_SLOT * k + AUDIO_END for k in groups)


def voice_clone_turn(placeholder: str) -> str:
    """get_sys_prompt(mode="voice_cloning") in chat(): the parts of a message joined by newlines."""
    return f"<|im_start|>user\n{VOICE_CLONE_INSTRUCTION}\n{placeholder}<|im_end|>\n"


def voice_assistant_turn(placeholder: str) -> str:
    """get_sys_prompt(mode="audio_assistant") in streaming_prefill: the parts joined with nothing between."""
    return f"<|im_start|>user\n{VOICE_CLONE_INSTRUCTION}{placeholder}{VOICE_ASSISTANT_STYLE}<|im_end|>\n"


@dataclass(frozen=True)
class Condition:
    """The TTS condition slots: `ids` has `condition_length` entries, `n` is the text length."""

    ids: list[int]
    n: int


class Tokenizer:
    """One `tokenizer.json` on the Rust `tokenizers` engine, as transformers' PreTrainedTokenizerFast
    uses it (encode without special tokens, decode keeping them, the WordPiece clean-up of spaces before
    punctuation where asked), without importing transformers: that import alone is over a second of
    every start. tests/test_tokenizers.py holds it to transformers' results."""

    def __init__(self, path: Path, clean_up_spaces: bool):
        from tokenizers import Tokenizer as Engine

        self.engine = Engine.from_file(str(path))
        self.clean_up_spaces = clean_up_spaces
        unk = getattr(self.engine.model, "unk_token", None)
        self.unk_token_id = self.engine.token_to_id(unk) if unk else None

    def __len__(self) -> int:
        """Ids in use, added tokens included (what len() of a transformers tokenizer gives)."""
        return self.engine.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text, add_special_tokens=False).ids

    def offsets(self, text: str) -> list[tuple[int, int]]:
        return self.engine.encode(text, add_special_tokens=False).offsets

    def decode(self, ids: list[int]) -> str:
        text = self.engine.decode(list(ids), skip_special_tokens=False)
        if self.clean_up_spaces:  # transformers' clean_up_tokenization
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.engine.token_to_id(token)

    def convert_ids_to_tokens(self, i: int) -> str | None:
        return self.engine.id_to_token(i)


class Tokenizers:
    def __init__(self, model_dir: Path):
        # the checkpoint's tokenizer.json files: the same tokenization the reference gets, without its
        # remote-code tokenizer classes
        main = model_dir / "tokenizer.json"
        bert = model_dir / "assets" / "chattts_tokenizer" / "tokenizer.json"
        for f in (main, bert):
            if not f.is_file():
                raise CheckpointError(f"tokenizer file missing: {f}")
        try:
            self.llm = Tokenizer(main, clean_up_spaces=False)
            self.bert = Tokenizer(bert, clean_up_spaces=True)
        except Exception as e:  # tokenizers raises plain Exceptions on malformed JSON
            raise CheckpointError(f"cannot read tokenizer: {e}") from e
        self.spk_id = self._llm_id("<|spk|>")
        self.im_start_id = self._llm_id("<|im_start|>")
        self.im_end_id = self._llm_id("<|im_end|>")
        self.endoftext_id = self._llm_id("<|endoftext|>")
        self.tts_eos_id = self._llm_id("<|tts_eos|>")
        self.stts = self._bert_id("[Stts]")
        self.spk_emb = self._bert_id("[spk_emb]")
        self.etts = self._bert_id("[Etts]")
        self.ptts = self._bert_id("[Ptts]")
        self.pad = self._bert_id("[PAD]")

    @functools.cached_property
    def audio_slot_id(self) -> int:
        """Id of <unk>, the audio placeholder (looked up when a voice is first used: a checkpoint
        without an audio encoder need not have it)."""
        i = self.llm.convert_tokens_to_ids(AUDIO_SLOT)
        if i is None or self.llm.convert_ids_to_tokens(i) != AUDIO_SLOT:
            raise CheckpointError(f"LLM tokenizer has no token {AUDIO_SLOT}")
        for token in (AUDIO_START, AUDIO_END):
            self._llm_id(token)
        return i

    def _llm_id(self, token: str) -> int:
        return self._lookup(self.llm, token, "LLM tokenizer")

    def _bert_id(self, token: str) -> int:
        return self._lookup(self.bert, token, "ChatTTS tokenizer")

    @staticmethod
    def _lookup(tok, token: str, what: str) -> int:
        i = tok.convert_tokens_to_ids(token)
        if i is None or i == tok.unk_token_id or tok.convert_ids_to_tokens(i) != token:
            raise CheckpointError(f"{what} has no token {token}")
        return i

    def encode_llm(self, text: str) -> list[int]:
        return self.llm.encode(text)

    def encode_bert(self, text: str) -> list[int]:
        return self.bert.encode(text)

    def bert_offsets(self, text: str) -> list[tuple[int, int]]:
        """(start, end) character span of each BERT token of `text`."""
        return self.bert.offsets(text)

    def condition(self, text: str, reserved: int) -> Condition:
        """prepare_tts_text: [Stts][spk_emb] text [Etts] [PAD]... [Ptts], `reserved` + 3 ids.

        Text of `reserved` BERT tokens or more is cut to its first `reserved` tokens with no [Etts]
        and no padding, as the reference does (callers that must not lose text split it first).
        """
        ids = self.encode_bert(text)
        n = len(ids)
        if n < reserved:
            body = ids + [self.etts] + [self.pad] * (reserved - n - 1)
        else:
            n = reserved
            body = ids[:reserved]
        return Condition(ids=[self.stts, self.spk_emb] + body + [self.ptts], n=n)
