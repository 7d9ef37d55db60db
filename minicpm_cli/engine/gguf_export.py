"""Write the LLM of a MiniCPM-o 2.6 checkpoint as a llama.cpp GGUF file (architecture `qwen2`).

This is what OpenBMB's GGUF files hold (the `llm.*` tensors as a Qwen2ForCausalLM, spec §6), so the
`gguf` backend can be tested on files written from the tiny fixture, and speed-tested on full-size
random ones. Tensor names follow llama.cpp's qwen2 layout; the tokenizer (byte-level BPE tokens,
types and merges) comes from the checkpoint's tokenizer.json. F32 only: other types come from
llama.cpp's own quantizer (`quantize`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(name: str) -> str:
    """`model.layers.3.mlp.up_proj.weight` (with `llm.` removed) -> `blk.3.ffn_up.weight`."""
    if name in NAMES:
        return NAMES[name]
    parts = name.split(".")
    if parts[:2] != ["model", "layers"]:
        raise KeyError(name)
    return f"blk.{parts[2]}.{LAYER['.'.join(parts[3:])]}"


def _tokenizer(tokenizer_json: Path, vocab_size: int) -> tuple[list[str], list[int], list[str], dict]:
    data = json.loads(tokenizer_json.read_text())
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    special = {}
    for t in data.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
        special[t["content"]] = t["id"]
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [5] * vocab_size  # unused
    for tok, i in vocab.items():
        if i < vocab_size:
            tokens[i] = tok
            types[i] = 3 if tok in special else 1  # control / normal
    merges = data["model"].get("merges", [])
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return tokens, types, merges, special


def write(path: str | Path, config: dict, tensors, tokenizer_json: str | Path, ftype: str = "F32") -> Path:
    """`tensors`: iterable of (name without `llm.`, tensor). `config`: the checkpoint's config.json.
    `ftype` F32, or F16 (matrices in float16, norms and biases in float32, as llama.cpp's converter)."""
    import gguf

    if ftype not in ("F32", "F16"):
        raise ValueError(f"GGUF ftype {ftype}: F32 or F16 (quantize() makes the others)")
    half = ftype == "F16"

    path = Path(path)
    vocab = config["vocab_size"]
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("MiniCPM-o-2_6 LLM")
    w.add_context_length(config.get("max_position_embeddings", 32768))
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config.get("num_key_value_heads", config["num_attention_heads"]))
    w.add_rope_freq_base(float(config.get("rope_theta", 1e6)))
    w.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if half else gguf.LlamaFileType.ALL_F32)
    tokens, types, merges, special = _tokenizer(Path(tokenizer_json), vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, tok in (("bos", "<|im_start|>"), ("eos", "<|im_end|>"), ("pad", "<|endoftext|>")):
        if tok in special:
            getattr(w, f"add_{key}_token_id")(special[tok])
    for name, t in tensors:
        dt = torch.float16 if half and t.dim() == 2 else torch.float32
        w.add_tensor(gguf_name(name), t.detach().to(dt).cpu().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def from_checkpoint(ckpt, config: dict, tokenizer_json: str | Path, path: str | Path, ftype: str = "F32",
                    device: str = "cpu") -> Path:
    """The `llm.*` tensors of a Checkpoint (or RandomCheckpoint, drawn on `device`) as a GGUF."""
    names = ckpt.keys("llm.")
    return write(path, config, ((n[len("llm."):], ckpt.tensor(n, torch.float32, device)) for n in names),
                 tokenizer_json, ftype)


def quantize(src: str | Path, dst: str | Path, ftype: str = "Q8_0") -> Path:
    """llama.cpp's own quantizer (through llama-cpp-python): F32 GGUF -> Q8_0, Q4_K_M, ..."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype} (code {rc})")
    return Path(dst)
