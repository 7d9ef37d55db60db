"""The LLM side of a spoken reply: prompts, token choice and text pieces (spec §4.5).

`reply_pieces` reproduces the reference's `streaming_prefill` + `llm_generate_chunk`: the user turn is
prefilled (after a voice's system turn, if there is one), the 9-token generate prompt is appended,
and tokens come in pieces of 3 (one reference `generate()` call each). Each call's repetition penalty
sees only that call's inputs and outputs; trailing tokens that decode to an incomplete UTF-8
character (U+FFFD) are held back to the next piece. The first piece carries the hidden state at
`<|spk|>`. Works with any backend (`LLMStage`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .sampling import TokenNoise, choose, token_noise, top_p
from .tensorio import to_device
from .text import ASSISTANT_TTS_PREFIX, Tokenizers

# streaming_generate appends this after the user turn; with a text-only first turn the context holds
# `<|im_end|>\n` twice (spec §7.5). We keep it: it is the flow the model was benchmarked with and the
# one the parity goldens pin down.
GENERATE_PROMPT = "<|im_end|>\n" + ASSISTANT_TTS_PREFIX
TOKENS_PER_PIECE = 3
# what a forced reply (random weights) says: its 24 tokens (loading.FORCED_REPLY_TOKENS), over again
# if more are asked for. A random LLM's own tokens make another text for every prompt, seed and
# voice, and with it another count of pieces before the TTS holds the 10 text tokens it starts on (2
# or 3 pieces, 19 ms apart on an H100), which timings then mix up with what they compare. Each token
# of this text is a whole word or mark in the bundled test tokenizer (tests/test_bench.py), and its
# first audio waits for 3 pieces; Qwen2's tokenizer (not bundled, so not checked) keeps such common
# words whole too, so a real reply of this text would wait for as many.
FORCED_REPLY_TEXT = "I'm fine, thank you. I can help you today. What can I do for you? I can help."


def user_turn(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n"


def later_user_turn(text: str) -> str:
    """A user message prefilled after another message of the session (the voice's system turn):
    streaming_prefill opens it but leaves it to the generate prompt's <|im_end|> to close."""
    return f"<|im_start|>user\n{text}"


@dataclass(frozen=True)
class LLMSampling:
    """The reference's streaming_generate settings; the benchmark used temperature 0.1."""

    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 100
    repetition_penalty: float = 1.05


@dataclass(frozen=True)
class Piece:
    text: str  # decoded text of this piece (may be empty while bytes are held back)
    ids: list[int]  # the token ids generated in this call
    spk_hidden: Tensor | None = None  # first piece only: LLM hidden state at <|spk|>


def next_token(logits: Tensor, window: list[int], s: LLMSampling, noise: TokenNoise | None,
               banned: list[int] | None = None, vocab: int | None = None) -> Tensor:
    """transformers' order: repetition penalty, temperature, top-k, top-p, then a draw with the
    stream's `noise` (or the argmax when None). `banned` ids and ids from `vocab` on are never chosen
    (forced-length benchmark runs)."""
    return next_tokens(logits[None], [window], s, [noise], banned, vocab)[0]


def next_tokens(logits: Tensor, windows: list[list[int]], s: LLMSampling, noises: list[TokenNoise | None],
                banned: list[int] | None = None, vocab: int | None = None) -> Tensor:
    """`next_token` for several streams with the same settings at once: logits (n, V), each row with
    its own window and noise (None: greedy) -> (n,) ids. Every step works row by row."""
    scores = logits.float()
    dev = scores.device
    if banned:
        scores = scores.index_fill(1, to_device(banned, dev), float("-inf"))
    if vocab is not None and vocab < scores.shape[1]:
        scores = torch.cat([scores[:, :vocab], torch.full_like(scores[:, vocab:], float("-inf"))], dim=1)
    if s.repetition_penalty != 1.0:
        width = max(len(w) for w in windows)  # (a shorter window repeats its first id: the same penalty)
        ids = to_device([w + w[:1] * (width - len(w)) for w in windows], dev)
        picked = scores.gather(1, ids)
        picked = torch.where(picked < 0, picked * s.repetition_penalty, picked / s.repetition_penalty)
        scores = scores.scatter(1, ids, picked)
    scores = scores / s.temperature
    # top-k as the k best (ids in order of score): top-p and the draw then look at k values a row,
    # not the whole vocabulary (what top-k masks has probability 0 either way)
    best, ids = torch.topk(scores, min(max(s.top_k, 1), scores.shape[1]))
    probs = top_p(best, s.top_p).softmax(-1)
    if all(n is None for n in noises):
        return ids[:, 0]  # (the argmax of the probabilities: topk puts the best first)
    k = ids.shape[1]
    one = probs.new_ones(k) if None in noises else None  # (argmax(p / 1) is the greedy choice)
    q = [one if n is None else n.next(k) for n in noises]
    q = q[0][None] if len(q) == 1 else torch.stack(q)
    return ids.gather(1, choose(probs, q)[:, None])[:, 0]


def reply_pieces(llm, tok: Tokenizers, user_text: str, s: LLMSampling, generator: torch.Generator | None,
                 max_tokens: int, force_length: bool = False,
                 voice: Callable[[], object] | None = None) -> Iterator[Piece]:
    """`force_length` (benchmarks with random weights): the reply has max_tokens tokens (rounded up to
    whole pieces of 3), those of FORCED_REPLY_TEXT (repeated as needed); each is still chosen from the
    logits as usual (the same work, the end tokens and ids the tokenizer cannot decode banned) and
    then replaced. `voice`: starts `llm` on the reference's audio-assistant system turn (spec §4.4,
    §4.5; `Synthesizer.voice_context`); the user message then follows as a later message."""
    terminators = {tok.im_end_id, tok.endoftext_id}
    # the chosen id, on the host (a batch's lane: chosen and fetched together with the other streams')
    pick = getattr(llm, "pick", None) or (lambda *args: int(next_token(*args)))
    noise = token_noise(generator)
    banned = sorted(terminators | {tok.tts_eos_id}) if force_length else None
    vocab = len(tok.llm) if force_length else None
    forced = tok.encode_llm(FORCED_REPLY_TEXT) if force_length else None
    if voice is None:
        llm.reset()
        turn = tok.encode_llm(user_turn(user_text))
    else:
        voice()
        turn = tok.encode_llm(later_user_turn(user_text))
    inputs = tok.encode_llm(GENERATE_PROMPT)
    # the user's turn and the generate prompt in one forward, where the reference runs two: attention
    # is causal, so the generate prompt's K/V, hidden states and logits are the same (to the bit on
    # the batch-invariant kernels), for one read of the weights instead of two
    prompt = turn + inputs
    spk_pos = len(turn) + inputs.index(tok.spk_id)
    held: list[int] = []
    produced = 0
    first = True
    while True:
        window = list(inputs)  # (the repetition penalty's: the reference's generate call's ids)
        logits, hidden = llm.forward(prompt)
        spk_hidden = hidden[spk_pos].clone() if first else None  # kept past the next forward
        new: list[int] = []
        ended = False
        for k in range(TOKENS_PER_PIECE):
            t = pick(logits, window, s, noise, banned, vocab)
            if forced is not None:
                t = forced[(produced + k) % len(forced)]
            new.append(t)
            window.append(t)
            if t in terminators:
                ended = True
                break
            if k < TOKENS_PER_PIECE - 1:
                logits, _ = llm.forward([t])
        produced += len(new)
        ids = held + new
        end = _complete_prefix(tok, ids)
        held = ids[end:]
        yield Piece(text=_decode(tok, ids[:end], terminators) if end else "", ids=new, spk_hidden=spk_hidden)
        first = False
        if ended or produced >= max_tokens:
            return
        inputs = prompt = [new[-1]]


def _complete_prefix(tok: Tokenizers, ids: list[int]) -> int:
    """Length of the longest prefix whose decoded text does not end in U+FFFD."""
    end = len(ids)
    while end > 0 and tok.llm.decode(ids[:end]).endswith("\ufffd"):
        end -= 1
    return end


def _decode(tok: Tokenizers, ids: list[int], terminators: set[int]) -> str:
    """The reference's _decode_text, except that id 0 is kept (it drops it as padding, but in the
    Qwen2 vocabulary id 0 is "!", so standalone exclamation marks vanished from the speech)."""
    if ids and ids[0] == tok.im_start_id:
        ids = ids[1:]
    if ids and ids[-1] in terminators:
        ids = ids[:-1]
    return tok.llm.decode(ids)
