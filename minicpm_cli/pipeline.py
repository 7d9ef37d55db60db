"""The speech path: text -> LLM speaker state -> TTS codes -> DVAE + Vocos -> 24 kHz audio.

`Synthesizer.load(...)` builds every stage from a checkpoint in the official layout; `say(text)`
runs the reference's read-aloud path (spec §4.3) on the caller's text. The LLM stage is whatever
backend was named; the TTS head, DVAE and Vocos are shared by all backends. The CLI is a thin layer
over this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

import backends

from .checkpoint import DEFAULT_MODEL, Checkpoint, load_module, read_config, resolve
from .codec import Codec
from .errors import CheckpointError, DeviceError, UsageError
from .models.chattts import ChatTTS, TTSConfig, fold_weight_norm
from .sampling import Sampling
from .text import Tokenizers, read_prompt
from .tts import MAX_FRAMES, TTSRunner

SAMPLE_RATE = 24000
LLM_CONTEXT = 4096


@dataclass(frozen=True)
class Utterance:
    codes: Tensor  # (T, num_vq) audio codes, on the CPU
    audio: np.ndarray  # float32 mono samples at `sample_rate`
    sample_rate: int = SAMPLE_RATE


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError("--device cuda: no CUDA device is available (use --device cpu)")
    try:
        return torch.device(device)
    except RuntimeError:
        raise DeviceError(f"unknown device '{device}' (use auto, cuda or cpu)") from None


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
    if dtype not in table:
        raise DeviceError(f"unknown dtype '{dtype}' (use auto, bfloat16 or float32)")
    return table[dtype]


def build_tts(ckpt: Checkpoint, config: dict, *, device, dtype) -> ChatTTS:
    if "tts_config" not in config:
        raise CheckpointError(f"{ckpt.root / 'config.json'} has no tts_config: not a MiniCPM-o checkpoint")
    with torch.device("meta"):
        model = ChatTTS(TTSConfig.from_hf(config["tts_config"]))
    c = model.config
    heads = [
        fold_weight_norm(
            ckpt.tensor(f"tts.head_code.{q}.parametrizations.weight.original0", torch.float32),
            ckpt.tensor(f"tts.head_code.{q}.parametrizations.weight.original1", torch.float32),
        )
        for q in range(c.num_vq)
    ]
    expected = (c.num_audio_tokens, c.decoder.dim)
    for q, w in enumerate(heads):
        if tuple(w.shape) != expected:
            raise CheckpointError(
                f"tensor tts.head_code.{q}.parametrizations.weight.original1 has shape {list(w.shape)}, "
                f"expected {list(expected)}")
    load_module(model, ckpt, "tts.", dtype, device, derived={"heads": torch.stack(heads).to(device, dtype)})
    return model.eval()


def build_codec(ckpt: Checkpoint, root: Path, *, device) -> Codec:
    vocos_path = root / "assets" / "Vocos.pt"
    try:
        vocos = torch.load(vocos_path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise CheckpointError(f"vocoder weights missing: {vocos_path}") from None
    except Exception as e:
        raise CheckpointError(f"cannot read {vocos_path}: {e}") from None
    dvae = ckpt.state_dict("tts.dvae.", torch.float32, skip=("encoder.", "downsample_conv."))
    try:
        return Codec.from_tensors(dvae, vocos, device)
    except (KeyError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"DVAE/Vocos weights do not fit: {e}") from None


class Synthesizer:
    """A loaded speech path. Not thread-safe: one utterance at a time."""

    sample_rate = SAMPLE_RATE

    def __init__(self, tokenizers: Tokenizers, llm: backends.LLMStage, tts: ChatTTS, codec: Codec):
        self.tokenizers, self.llm, self.tts_model, self.codec = tokenizers, llm, tts, codec
        self.tts = TTSRunner(tts)
        self.device = tts.emb_text.weight.device

    @classmethod
    def load(cls, model: str = DEFAULT_MODEL, *, backend: str = "eager", device: str = "auto",
             dtype: str = "auto") -> "Synthesizer":
        be = backends.get(backend)
        be.check()
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        root = resolve(model)
        config = read_config(root)
        tokenizers = Tokenizers(root)
        ckpt = Checkpoint(root)
        tts = build_tts(ckpt, config, device=dev, dtype=dt)
        codec = build_codec(ckpt, root, device=dev)
        llm = be.create(ckpt, config, device=dev, dtype=dt, max_len=LLM_CONTEXT)
        return cls(tokenizers, llm, tts, codec)

    def speaker(self, prompt_ids: list[int]) -> Tensor:
        """Run the LLM over a prompt; the projected hidden state at its last <|spk|> (hidden,)."""
        spk_pos = len(prompt_ids) - 1 - prompt_ids[::-1].index(self.tokenizers.spk_id)
        self.llm.reset()
        _, hidden = self.llm.forward(prompt_ids)
        with torch.inference_mode():
            return self.tts_model.speaker(hidden[spk_pos].to(self.tts.dtype))

    def read_codes(self, text: str, sampling: Sampling = Sampling(),
                   progress: Callable[[int], None] | None = None) -> Tensor:
        """The reference's read-aloud codes (T, num_vq) for `text` (the caller's text, not an LLM rewrite)."""
        if not text.strip():
            raise UsageError("no text to speak")
        tok = self.tokenizers
        reserved = self.tts.config.streaming_text_reserved_len
        cond = tok.condition(text, reserved)
        if cond.n == 0:
            raise UsageError("the text has nothing the TTS tokenizer can read")
        if cond.n >= reserved:
            raise UsageError(f"text too long: {cond.n}+ TTS tokens, at most {reserved - 1} fit one utterance")
        spk = self.speaker(tok.encode_llm(read_prompt(text)))
        generator = sampling.generator(self.device)
        self.tts.start(cond.n)
        self.tts.prefill(cond.ids[: self.tts.L - 1], 0, spk)
        frames, total = [], 0
        while True:
            codes, finished = self.tts.generate(generator)
            frames.append(codes)
            total += len(codes)
            if progress:
                progress(len(codes))
            if finished or total > MAX_FRAMES:
                break
        return torch.cat(frames).cpu()

    def say(self, text: str, sampling: Sampling = Sampling(),
            progress: Callable[[int], None] | None = None) -> Utterance:
        codes = self.read_codes(text, sampling, progress)
        with torch.inference_mode():
            audio = self.codec.decode(codes.to(self.device)) if len(codes) else torch.zeros(0)
        return Utterance(codes=codes, audio=audio.float().cpu().numpy())
