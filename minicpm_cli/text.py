"""Tokenizers, prompts and the TTS condition layout.

The LLM tokenizer (Qwen2 byte-level BPE) and the ChatTTS BERT tokenizer are loaded from the
checkpoint's files; every special-token id is looked up in them, never hard-coded, because the ids
differ between checkpoints. This module knows strings and ids, nothing about tensors or models.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError

READ_INSTRUCTION = "Please read the text below."
ASSISTANT_TTS_PREFIX = "<|im_start|>assistant\n<|spk_bos|><|spk|><|spk_eos|><|tts_bos|>"


# A run of sentence/clause punctuation (and closing quotes/brackets) followed by space or the end;
# CJK full-width punctuation needs no space after it.
_PUNCT = r"[.!?;:,\u2026]+[\"')\]\u201d\u2019\u00bb]*"
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


def read_prompt(text: str) -> str:
    """The prompt of the reference's read-aloud path (chat() with the TTS template, no system turn)."""
    return f"<|im_start|>user\n{READ_INSTRUCTION}\n{text}<|im_end|>\n{ASSISTANT_TTS_PREFIX}"


@dataclass(frozen=True)
class Condition:
    """The TTS condition slots: `ids` has `condition_length` entries, `n` is the text length."""

    ids: list[int]
    n: int


class Tokenizers:
    def __init__(self, model_dir: Path):
        # transformers' fast-tokenizer wrapper over tokenizer.json: the same tokenization the
        # reference gets, without its remote-code tokenizer classes.
        from transformers import PreTrainedTokenizerFast

        main = model_dir / "tokenizer.json"
        bert = model_dir / "assets" / "chattts_tokenizer" / "tokenizer.json"
        for f in (main, bert):
            if not f.is_file():
                raise CheckpointError(f"tokenizer file missing: {f}")
        try:
            self.llm = PreTrainedTokenizerFast(tokenizer_file=str(main), clean_up_tokenization_spaces=False)
            self.bert = PreTrainedTokenizerFast(tokenizer_file=str(bert), clean_up_tokenization_spaces=True)
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
        return self.llm.encode(text, add_special_tokens=False)

    def encode_bert(self, text: str) -> list[int]:
        return self.bert.encode(text, add_special_tokens=False)

    def bert_offsets(self, text: str) -> list[tuple[int, int]]:
        """(start, end) character span of each BERT token of `text`."""
        return self.bert(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]

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
