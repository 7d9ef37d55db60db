"""Synthetic MiniCPM-o 2.6 checkpoints in the official `openbmb/MiniCPM-o-2_6` layout.

Contract: a `SyntheticSpec` (sizes only) goes in; out comes a directory that a loader of the official
checkpoint cannot tell apart by names, shapes, dtypes or files: `config.json`, `model.safetensors` (or
HF-style `model-0000X-of-0000N.safetensors` shards + `model.safetensors.index.json`), `assets/Vocos.pt`
(float32 state dict) and tokenizer files copied from an existing checkpoint directory; with
`include_audio`, the audio encoder voices use too (`apm.*`, `audio_projection_layer.*`, in shards of
their own; config.json's `audio_config` then gives its sizes). Weights are seeded random values of
realistic scale. Each tensor has its own generator seeded from (seed, name), so its values do not
depend on order, sharding or the other tensors (for a given device type). Tensors are drawn one at a
time on `device` and shards are written as they fill, so host memory peaks at about one shard plus
the largest tensor, even at full size (~7.9B llm+tts parameters; pass `max_shard_bytes`).
This module knows nothing about forward passes. It is over the house's ~450 lines as one table:
the plan of every tensor of the official layout with its initialisation, which the writer and the
random checkpoint both read.
"""

from __future__ import annotations

import json
import math
import shutil
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

Init = Callable[[tuple[int, ...], torch.Generator, torch.device], Tensor]  # float32 values
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "added_tokens.json", "preprocessor_config.json")
_VISION_HIDDEN = 1152  # SigLIP's width, as in config.json


@dataclass(frozen=True)
class SyntheticSpec:
    """Sizes of every part; defaults are the real MiniCPM-o 2.6 sizes (`full()`)."""

    # LLM (Qwen2ForCausalLM, q/k/v biases, untied lm_head)
    hidden: int = 3584
    layers: int = 28
    heads: int = 28
    kv_heads: int = 4
    intermediate: int = 18944
    vocab: int = 151700
    rope_theta: float = 1e6
    rms_eps: float = 1e-6
    # TTS (ConditionalChatTTS: Llama backbone, no biases)
    tts_llm_dim: int = 3584
    tts_hidden: int = 768
    tts_intermediate: int = 3072
    tts_heads: int = 12
    tts_layers: int = 20
    tts_max_positions: int = 4096
    tts_backbone_vocab: int = 32000  # `tts.model.embed_tokens`, stored but never used
    num_audio_tokens: int = 626  # 5**4 FSQ codes + EOS (625)
    num_text_tokens: int = 21178
    num_vq: int = 4
    # DVAE: GFSQ of `gfsq_dim` = groups x per-group width, each group `residuals` FSQs of 4-d codes
    gfsq_dim: int = 1024
    fsq_levels: tuple[int, ...] = (5, 5, 5, 5)
    dvae_groups: int = 2
    dvae_residuals: int = 2
    dvae_idim: int = 512
    dvae_odim: int = 512
    dvae_hidden: int = 256
    dvae_bn: int = 128
    dvae_layers: int = 12
    # Vocos (backbone + ISTFT head)
    vocos_dim: int = 512
    vocos_intermediate: int = 1536
    vocos_layers: int = 8
    n_fft: int = 1024
    hop: int = 256
    n_mels: int = 100
    sample_rate: int = 24000
    # audio encoder (voices only): Whisper-medium's encoder `apm.*`, projection into the LLM, pooling
    audio_dim: int = 1024
    audio_layers: int = 24
    audio_heads: int = 16
    audio_ffn: int = 4096
    audio_mels: int = 80
    audio_positions: int = 1500  # encoder frames: 30 s
    audio_pool: int = 2  # encoder frames per LLM embedding (`audio_pool_step`)

    def __post_init__(self) -> None:
        problems = [msg for bad, msg in [
            (self.hidden % self.heads, "hidden must be divisible by heads"),
            (self.heads % self.kv_heads, "heads must be divisible by kv_heads"),
            (self.tts_hidden % self.tts_heads, "tts_hidden must be divisible by tts_heads"),
            (self.audio_dim % self.audio_heads, "audio_dim must be divisible by audio_heads"),
            (self.tts_llm_dim != self.hidden, "tts_llm_dim must equal the LLM hidden size"),
            (self.gfsq_dim != self.dvae_groups * self.dvae_idim, "gfsq_dim must be dvae_groups * dvae_idim"),
            (self.num_vq != self.dvae_groups * self.dvae_residuals, "num_vq must be groups * residuals"),
            (math.prod(self.fsq_levels) + 1 != self.num_audio_tokens, "num_audio_tokens must be prod(levels)+1"),
        ] if bad]
        if problems:
            raise ValueError("invalid SyntheticSpec: " + "; ".join(problems))

    @classmethod
    def full(cls) -> SyntheticSpec:
        return cls()

    @classmethod
    def tiny(cls) -> SyntheticSpec:
        """The sizes of tests/fixtures/tiny-minicpmo and of its audio encoder (tiny-minicpmo-voice; see
        PARITY.md)."""
        return replace(cls(), hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=1000,
                       tts_llm_dim=64, tts_hidden=64, tts_intermediate=128, tts_heads=4, tts_layers=2,
                       gfsq_dim=64, dvae_idim=32, dvae_odim=32, dvae_hidden=32, dvae_bn=16, dvae_layers=2,
                       vocos_dim=32, vocos_intermediate=64, vocos_layers=2,
                       audio_dim=64, audio_layers=2, audio_heads=4, audio_ffn=256)

    def with_official_audio(self) -> SyntheticSpec:
        """These sizes with the official audio encoder's: what config.json says of a checkpoint
        written without the encoder (the official file's `audio_config`, as in tiny-minicpmo)."""
        return replace(self, **{f.name: f.default for f in fields(self) if f.name.startswith("audio_")})


def _normal(mean: float, std: float) -> Init:
    return lambda shape, g, dev: torch.randn(shape, generator=g, device=dev).mul_(std).add_(mean)


def _uniform(lo: float, hi: float) -> Init:
    return lambda shape, g, dev: torch.rand(shape, generator=g, device=dev).mul_(hi - lo).add_(lo)


def _fan_in() -> Init:  # std 1/sqrt(fan_in), fan_in = product of all dims but the first
    return lambda shape, g, dev: _normal(0.0, math.prod(shape[1:]) ** -0.5)(shape, g, dev)


_GAIN, _LAYER_SCALE = _normal(1.0, 0.1), _normal(0.3, 0.1)
Plan = Iterator[tuple[str, tuple[int, ...], Init]]


def _linear(name: str, out: int, inp: int, bias_std: float | None = None) -> Plan:
    yield f"{name}.weight", (out, inp), _fan_in()
    if bias_std is not None:
        yield f"{name}.bias", (out,), _normal(0.0, bias_std)


def _conv(name: str, out: int, inp: int, k: int, bias: bool = True) -> Plan:
    yield f"{name}.weight", (out, inp, k), _fan_in()
    if bias:
        yield f"{name}.bias", (out,), _normal(0.0, 0.05)


def _convnext(p: str, dim: int, inter: int, scale_name: str) -> Plan:
    """One ConvNeXt block as in the DVAE (`coef`) and Vocos (`gamma`)."""
    yield from _conv(f"{p}.dwconv", dim, 1, 7)
    yield f"{p}.norm.weight", (dim,), _GAIN
    yield f"{p}.norm.bias", (dim,), _normal(0.0, 0.05)
    yield from _linear(f"{p}.pwconv1", inter, dim, 0.05)
    yield from _linear(f"{p}.pwconv2", dim, inter, 0.05)
    yield f"{p}.{scale_name}", (dim,), _LAYER_SCALE


def _layer_norm(name: str, dim: int) -> Plan:
    yield f"{name}.weight", (dim,), _GAIN
    yield f"{name}.bias", (dim,), _normal(0.0, 0.05)


def _decoder_layers(p: str, n: int, h: int, inter: int, kv_dim: int, qkv_bias: float | None) -> Plan:
    for i in range(n):
        q = f"{p}.layers.{i}"
        for proj, out in (("q", h), ("k", kv_dim), ("v", kv_dim)):
            yield from _linear(f"{q}.self_attn.{proj}_proj", out, h, qkv_bias)
        yield from _linear(f"{q}.self_attn.o_proj", h, h)
        yield from _linear(f"{q}.mlp.gate_proj", inter, h)
        yield from _linear(f"{q}.mlp.up_proj", inter, h)
        yield from _linear(f"{q}.mlp.down_proj", h, inter)
        yield f"{q}.input_layernorm.weight", (h,), _GAIN
        yield f"{q}.post_attention_layernorm.weight", (h,), _GAIN
    yield f"{p}.norm.weight", (h,), _GAIN


def _dvae_stack(p: str, s: SyntheticSpec, idim: int, odim: int) -> Plan:
    yield from _conv(f"{p}.conv_in.0", s.dvae_bn, idim, 3)
    yield from _conv(f"{p}.conv_in.2", s.dvae_hidden, s.dvae_bn, 3)
    for i in range(s.dvae_layers):
        yield from _convnext(f"{p}.decoder_block.{i}", s.dvae_hidden, 4 * s.dvae_hidden, "coef")
    yield from _conv(f"{p}.conv_out", odim, s.dvae_hidden, 1, bias=False)


def _audio_encoder(s: SyntheticSpec) -> Plan:
    """Every tensor `models.audio_encoder.AudioEncoder` loads: Whisper's encoder (`apm.*`) and the
    projection into the LLM (`audio_projection_layer.*`); pooling has no weights."""
    d = s.audio_dim
    yield from _conv("apm.conv1", d, s.audio_mels, 3)
    yield from _conv("apm.conv2", d, d, 3)
    yield "apm.embed_positions.weight", (s.audio_positions, d), _normal(0.0, 0.02)
    for i in range(s.audio_layers):
        p = f"apm.layers.{i}"
        for proj in ("q", "k", "v", "out"):  # Whisper's k_proj has no bias
            yield from _linear(f"{p}.self_attn.{proj}_proj", d, d, None if proj == "k" else 0.05)
        yield from _layer_norm(f"{p}.self_attn_layer_norm", d)
        yield from _linear(f"{p}.fc1", s.audio_ffn, d, 0.05)
        yield from _linear(f"{p}.fc2", d, s.audio_ffn, 0.05)
        yield from _layer_norm(f"{p}.final_layer_norm", d)
    yield from _layer_norm("apm.layer_norm", d)
    yield from _linear("audio_projection_layer.linear1", s.hidden, d, 0.05)
    yield from _linear("audio_projection_layer.linear2", s.hidden, s.hidden, 0.05)


_AUDIO_SAMPLE = ("apm.conv1.", "apm.layer_norm.", "audio_projection_layer.")


def tensor_plan(spec: SyntheticSpec, *, include_unused: bool = True, include_audio: bool = False,
                include_vision_audio: bool = False) -> Plan:
    """(name, shape, init) of every checkpoint tensor, without allocating anything. `include_audio`:
    the whole audio encoder, at the spec's sizes; `include_vision_audio`: a few representative vision
    tensors, and of the official-size audio encoder unless `include_audio` gives all of it."""
    s, code_dim = spec, len(spec.fsq_levels)
    yield "llm.model.embed_tokens.weight", (s.vocab, s.hidden), _normal(0.0, 1.0)
    kv_dim = s.kv_heads * (s.hidden // s.heads)
    yield from _decoder_layers("llm.model", s.layers, s.hidden, s.intermediate, kv_dim, qkv_bias=0.3)
    yield from _linear("llm.lm_head", s.vocab, s.hidden)
    yield from _linear("tts.projector.linear1", s.tts_hidden, s.tts_llm_dim, 0.1)
    yield from _linear("tts.projector.linear2", s.tts_hidden, s.tts_hidden, 0.1)
    yield "tts.emb_text.weight", (s.num_text_tokens, s.tts_hidden), _normal(0.0, 0.25)
    for q in range(s.num_vq):
        yield f"tts.emb_code.{q}.weight", (s.num_audio_tokens, s.tts_hidden), _normal(0.0, 0.25)
        wn = f"tts.head_code.{q}.parametrizations.weight"
        yield f"{wn}.original0", (s.num_audio_tokens, 1), _uniform(0.5, 1.5)  # weight-norm g > 0
        yield f"{wn}.original1", (s.num_audio_tokens, s.tts_hidden), _normal(0.0, 1.0)
    if include_unused:
        yield "tts.model.embed_tokens.weight", (s.tts_backbone_vocab, s.tts_hidden), _normal(0.0, 0.02)
    yield from _decoder_layers("tts.model", s.tts_layers, s.tts_hidden, s.tts_intermediate, s.tts_hidden, None)
    yield "tts.dvae.coef", (1, s.n_mels, 1), _uniform(0.5, 1.5)
    for g in range(s.dvae_groups):
        rvq = f"tts.dvae.vq_layer.quantizer.rvqs.{g}"
        if include_unused:
            yield from _linear(f"{rvq}.project_in", code_dim, s.dvae_idim, 0.05)
        yield from _linear(f"{rvq}.project_out", s.dvae_idim, code_dim, 0.05)
    yield from _dvae_stack("tts.dvae.decoder", s, s.dvae_idim, s.dvae_odim)
    yield from _conv("tts.dvae.out_conv", s.n_mels, s.dvae_odim, 3, bias=False)
    if include_unused:
        yield from _dvae_stack("tts.dvae.encoder", s, s.dvae_idim, s.gfsq_dim)
        yield from _conv("tts.dvae.downsample_conv.0", s.dvae_idim, s.n_mels, 3)
        yield from _conv("tts.dvae.downsample_conv.2", s.dvae_idim, s.dvae_idim, 4)
    if include_audio:
        yield from _audio_encoder(s)
    if include_vision_audio:  # a few representative non-speech tensors; a speech loader must skip them
        yield "vpm.embeddings.patch_embedding.weight", (_VISION_HIDDEN, 3, 14, 14), _fan_in()
        yield "vpm.post_layernorm.weight", (_VISION_HIDDEN,), _GAIN
        yield "resampler.query", (64, s.hidden), _normal(0.0, 0.02)
        yield "resampler.ln_post.weight", (s.hidden,), _GAIN
        if not include_audio:
            yield from (t for t in _audio_encoder(s.with_official_audio()) if t[0].startswith(_AUDIO_SAMPLE))


DRAW_CHUNK = 1 << 25  # elements drawn at once in float32: a full-size embedding is drawn in slices


def generator(name: str, seed: int, device: torch.device) -> torch.Generator:
    """A tensor's own generator: seeded by the checkpoint's seed and the tensor's name, so that its
    values do not depend on what was drawn before it (or on torch's global generators)."""
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def _draw(name: str, shape: tuple[int, ...], init: Init, seed: int, device: torch.device,
          dtype: torch.dtype = torch.float32) -> Tensor:
    """The tensor's values (float32 draws, seeded by name) as `dtype`. Tensors over DRAW_CHUNK
    elements are drawn in slices along dim 0 into the result, so a bfloat16 embedding never
    exists in float32 whole (2 GB more at the peak)."""
    g = generator(name, seed, device)
    n = math.prod(shape)
    if n <= DRAW_CHUNK or len(shape) < 2:
        return init(shape, g, device).to(dtype)
    out = torch.empty(shape, dtype=dtype, device=device)
    rows = max(1, DRAW_CHUNK // math.prod(shape[1:]))
    for i in range(0, shape[0], rows):
        part = out[i : i + rows]
        part.copy_(init(tuple(part.shape), g, device))
    return out


def _tensor(spec: SyntheticSpec, name: str, shape: tuple[int, ...], init: Init, seed: int,
            device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    t = _draw(name, shape, init, seed, device, dtype)
    if name == "tts.head_code.0.parametrizations.weight.original0":
        t[spec.num_audio_tokens - 1] = 1.5  # larger EOS gain so random-weight runs do end
    return t


def random_tensors(spec: SyntheticSpec, *, seed: int, dtype: torch.dtype = torch.bfloat16,
                   device: str | torch.device = "cpu", include_unused: bool = True, include_audio: bool = False,
                   include_vision_audio: bool = False) -> Iterator[tuple[str, Tensor]]:
    """Every checkpoint tensor, one at a time, as `dtype` on `device`."""
    device = torch.device(device)
    for name, shape, init in tensor_plan(spec, include_unused=include_unused, include_audio=include_audio,
                                         include_vision_audio=include_vision_audio):
        yield name, _tensor(spec, name, shape, init, seed, device, dtype)


class RandomCheckpoint:
    """The `Checkpoint` interface over random tensors drawn on demand (no files): the same values
    `write_checkpoint(..., include_audio=True)` would write for this spec and seed, made directly on
    the target device. The audio encoder's tensors are drawn only when asked for, like every other."""

    def __init__(self, spec: SyntheticSpec, *, seed: int = 0):
        self.spec, self.seed = spec, seed
        self.root = Path(f"<random weights, seed {seed}>")
        self.plan = {name: (shape, init) for name, shape, init
                     in tensor_plan(spec, include_unused=False, include_audio=True)}
        self.config = _config(spec, torch.bfloat16, 0, 0, audio=True)

    def keys(self, prefix: str) -> list[str]:
        return sorted(k for k in self.plan if k.startswith(prefix))

    def shape(self, key: str) -> tuple[int, ...]:
        return self.plan[key][0]

    def prefetch(self, keys, device="cpu") -> None:
        """Nothing to read ahead: tensors are drawn when asked for."""

    def tensor(self, key: str, dtype: torch.dtype | None = None, device=None) -> Tensor:
        shape, init = self.plan[key]
        return _tensor(self.spec, key, shape, init, self.seed, torch.device(device or "cpu"), dtype or torch.float32)

    def state_dict(self, prefix: str, dtype: torch.dtype | None = None, device="cpu",
                   skip: tuple[str, ...] = ()) -> dict[str, Tensor]:
        return {k[len(prefix):]: self.tensor(k, dtype, device) for k in self.keys(prefix)
                if not k[len(prefix):].startswith(skip)}

    def vocos_state(self) -> dict[str, Tensor]:
        return random_vocos_state(self.spec, self.seed)


def _mel_filterbank(s: SyntheticSpec) -> Tensor:
    """torchaudio.functional.melscale_fbanks(n_fft//2+1, 0, sr/2, n_mels, sr), HTK scale, no norm."""
    freqs = torch.linspace(0, s.sample_rate // 2, s.n_fft // 2 + 1)
    m_pts = torch.linspace(0.0, 2595.0 * math.log10(1.0 + s.sample_rate / 2 / 700.0), s.n_mels + 2)
    f_pts = 700.0 * (10 ** (m_pts / 2595.0) - 1.0)
    f_diff, slopes = f_pts[1:] - f_pts[:-1], f_pts.unsqueeze(0) - freqs.unsqueeze(1)
    down, up = -slopes[:, :-2] / f_diff[:-1], slopes[:, 2:] / f_diff[1:]
    return torch.clamp(torch.minimum(down, up), min=0.0)


def random_vocos_state(spec: SyntheticSpec, seed: int) -> dict[str, Tensor]:
    """A float32 CPU state dict strict-loadable into vocos 0.1.0 `Vocos` (ISTFT head, padding "same")."""
    s, bins, cpu = spec, spec.n_fft // 2 + 1, torch.device("cpu")

    def plan() -> Plan:
        yield from _conv("backbone.embed", s.vocos_dim, s.n_mels, 7)
        yield "backbone.norm.weight", (s.vocos_dim,), _GAIN
        yield "backbone.norm.bias", (s.vocos_dim,), _normal(0.0, 0.05)
        for i in range(s.vocos_layers):
            yield from _convnext(f"backbone.convnext.{i}", s.vocos_dim, s.vocos_intermediate, "gamma")
        yield "backbone.final_layer_norm.weight", (s.vocos_dim,), _GAIN
        yield "backbone.final_layer_norm.bias", (s.vocos_dim,), _normal(0.0, 0.05)
        yield from _linear("head.out", 2 * bins, s.vocos_dim)

    window = torch.hann_window(s.n_fft)
    state = {"feature_extractor.mel_spec.spectrogram.window": window,
             "feature_extractor.mel_spec.mel_scale.fb": _mel_filterbank(s)}
    state.update((n, _draw(n, shape, init, seed, cpu)) for n, shape, init in plan())
    # log-magnitude half biased to ~exp(-1) so the output stays far from the clip at 100; phase half ~N(0,1)
    state["head.out.bias"] = torch.cat([_draw("head.out.bias.mag", (bins,), _normal(-1.0, 0.3), seed, cpu),
                                        _draw("head.out.bias.phase", (bins,), _normal(0.0, 1.0), seed, cpu)])
    state["head.istft.window"] = window.clone()
    return state


def _config(spec: SyntheticSpec, dtype: torch.dtype, bos: int, eos: int, audio: bool = False) -> dict:
    """config.json; `audio`: the checkpoint has the audio encoder (its sizes, init_audio, chunk_input)."""
    s, a = spec, spec if audio else spec.with_official_audio()
    return {
        "_name_or_path": "openbmb/MiniCPM-o-2_6", "architectures": ["MiniCPMO"],
        "auto_map": {"AutoConfig": "configuration_minicpm.MiniCPMOConfig",
                     "AutoModel": "modeling_minicpmo.MiniCPMO",
                     "AutoModelForCausalLM": "modeling_minicpmo.MiniCPMO"},
        "model_type": "minicpmo", "attention_dropout": 0.0, "bos_token_id": bos, "eos_token_id": eos,
        "hidden_act": "silu", "hidden_size": s.hidden, "initializer_range": 0.02,
        "intermediate_size": s.intermediate, "max_position_embeddings": 32768, "max_window_layers": s.layers,
        "num_attention_heads": s.heads, "num_hidden_layers": s.layers, "num_key_value_heads": s.kv_heads,
        "rms_norm_eps": s.rms_eps, "rope_theta": s.rope_theta, "sliding_window": 131072,
        "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": s.vocab,
        "torch_dtype": str(dtype).removeprefix("torch."), "transformers_version": "4.44.2", "use_cache": True,
        "batch_vision_input": True, "drop_vision_last_layer": False, "image_size": 448, "query_num": 64,
        "patch_size": 14, "use_image_id": True, "vision_batch_size": 16,
        "slice_config": {"max_slice_nums": 9, "model_type": "minicpmv", "patch_size": 14, "scale_resolution": 448},
        "slice_mode": True,
        "vision_config": {"hidden_size": _VISION_HIDDEN, "image_size": 980, "intermediate_size": 4304,
                          "model_type": "siglip", "num_attention_heads": 16, "num_hidden_layers": 27,
                          "patch_size": 14},
        "audio_chunk_length": 1.0, "audio_pool_step": a.audio_pool,
        "audio_config": {"model_type": "whisper", "d_model": a.audio_dim, "encoder_layers": a.audio_layers,
                         "encoder_attention_heads": a.audio_heads, "encoder_ffn_dim": a.audio_ffn,
                         "num_mel_bins": a.audio_mels, "max_source_positions": a.audio_positions},
        "stream_input": False, "init_vision": False, "init_audio": audio, "init_tts": True,
        **({"chunk_input": True} if audio else {}),
        "tts_config": {"model_type": "conditional_chattts", "llm_dim": s.tts_llm_dim, "hidden_size": s.tts_hidden,
                       "intermediate_size": s.tts_intermediate, "num_attention_heads": s.tts_heads,
                       "num_hidden_layers": s.tts_layers, "max_position_embeddings": s.tts_max_positions,
                       "num_audio_tokens": s.num_audio_tokens, "num_text_tokens": s.num_text_tokens,
                       "num_mel_bins": s.n_mels, "num_vq": s.num_vq},
    }


def _copy_tokenizers(src: Path, out: Path) -> tuple[int, int]:
    """Copy the tokenizer files; return (bos, eos) = ids of <|endoftext|>, <|im_end|> as in the official config."""
    if not (src / "tokenizer_config.json").is_file() or not (src / "assets/chattts_tokenizer").is_dir():
        raise FileNotFoundError(f"{src} has no tokenizer_config.json or assets/chattts_tokenizer/")
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    shutil.copytree(src / "assets/chattts_tokenizer", out / "assets/chattts_tokenizer", dirs_exist_ok=True)
    ids = {}
    if (src / "tokenizer.json").is_file():
        ids = {t["content"]: t["id"] for t in json.loads((src / "tokenizer.json").read_text())["added_tokens"]}
    if (src / "added_tokens.json").is_file():
        ids.update(json.loads((src / "added_tokens.json").read_text()))
    if "<|endoftext|>" not in ids or "<|im_end|>" not in ids:
        raise ValueError(f"the tokenizer in {src} defines no <|endoftext|> / <|im_end|> token")
    return ids["<|endoftext|>"], ids["<|im_end|>"]


def _shard_groups(spec: SyntheticSpec, dtype: torch.dtype, max_shard_bytes: int | None,
                  include_audio: bool, include_vision_audio: bool) -> list[list[str]]:
    """Names per shard in write order; non-speech tensors never share a shard with speech ones."""
    shards: list[list[str]] = []
    size, kind, elt = 0, None, torch.empty((), dtype=dtype).element_size()
    for name, shape, _ in tensor_plan(spec, include_audio=include_audio, include_vision_audio=include_vision_audio):
        nbytes = math.prod(shape) * elt
        full = max_shard_bytes is not None and size + nbytes > max_shard_bytes
        speech = name.startswith(("llm.", "tts."))
        if not shards or speech != kind or (full and size > 0):
            shards.append([])
            size, kind = 0, speech
        shards[-1].append(name)
        size += nbytes
    return shards


def write_checkpoint(out_dir: str | Path, spec: SyntheticSpec, *, tokenizer_from: str | Path, seed: int = 0,
                     dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                     max_shard_bytes: int | None = None, include_audio: bool = False,
                     include_vision_audio: bool = False,
                     corrupt: Callable[[str, Tensor], Tensor | None] | None = None) -> Path:
    """Write a checkpoint directory and return its path.

    One `model.safetensors`, unless `max_shard_bytes` is set or `include_audio` (the audio encoder, for
    voices) or `include_vision_audio` asks for non-speech tensors (always in shards of their own). `corrupt(name, tensor)` may replace a tensor
    before it is written, or return None to leave it out: a hook for loader error tests.
    """
    out = Path(out_dir)
    (out / "assets").mkdir(parents=True, exist_ok=True)
    bos, eos = _copy_tokenizers(Path(tokenizer_from), out)
    (out / "config.json").write_text(json.dumps(_config(spec, dtype, bos, eos, include_audio), indent=2) + "\n")
    torch.save(random_vocos_state(spec, seed), out / "assets" / "Vocos.pt")

    groups = _shard_groups(spec, dtype, max_shard_bytes, include_audio, include_vision_audio)
    files = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    shard_of = {name: i for i, names in enumerate(groups) for name in names}
    left = [len(names) for names in groups]
    weight_map, pending, total = {}, {}, 0
    for name, t in random_tensors(spec, seed=seed, dtype=dtype, device=device, include_audio=include_audio,
                                  include_vision_audio=include_vision_audio):
        i = shard_of[name]
        if corrupt is not None:
            t = corrupt(name, t)
        if t is not None:
            pending[name] = t.contiguous().cpu()
            weight_map[name], total = files[i], total + t.numel() * t.element_size()
        left[i] -= 1
        if left[i] == 0:  # shard complete: write it and free its host memory
            save_file(pending, str(out / files[i]), metadata={"format": "pt"})
            pending = {}
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def parameter_count(spec: SyntheticSpec, prefix: str = "", *, include_unused: bool = True,
                    include_audio: bool = False) -> int:
    """Number of parameters whose name starts with `prefix`, from shapes only (nothing allocated)."""
    return sum(math.prod(shape) for name, shape, _
               in tensor_plan(spec, include_unused=include_unused, include_audio=include_audio)
               if name.startswith(prefix))
