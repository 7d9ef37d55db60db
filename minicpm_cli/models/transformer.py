"""A Llama/Qwen2-style decoder stack over a static KV cache (gpt-fast style).

Both the Qwen2 LLM and the ChatTTS backbone are this stack: RMSNorm, rotary attention with optional
q/k/v biases and grouped KV heads, a SiLU-gated MLP, and a final RMSNorm. Parameter names follow the
Hugging Face checkpoints (`layers.N.self_attn.q_proj.weight`, ...) so state dicts load unchanged.

Contract: `Decoder.forward(x, input_pos, mask, kv_len, rows=...)` takes embeddings `(B, T, dim)`, the
absolute positions of those T tokens (also their KV-cache slots): `(T,)` shared by the batch or
`(B, T)` one row of positions per sequence, a boolean mask `(1|B, 1, T, kv_len)` that is True where a
query may attend a cache slot, how many cache slots to attend over, and which rows of the cache the B
sequences own (a slice, or a `(B,)` index tensor; default the first B). It returns the post-final-norm
hidden states. Without a cache (`setup_cache` not called) the T tokens attend only to each other. The
module knows nothing about tokens, sampling or devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

# cuDNN's attention builds an execution plan per shape: with a KV length that grows every step it
# spent ~2.5 ms of host time per call on an H100 (measured), more than the whole layer.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class Embedding(nn.Embedding):
    """nn.Embedding whose random init is skipped on the meta device, where the models are built before
    their weights are loaded: there is nothing to fill there, and torch's meta `normal_` imports
    torch._dynamo (most of a second of every start)."""

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            super().reset_parameters()


@dataclass(frozen=True)
class DecoderConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate: int
    rope_theta: float
    norm_eps: float
    qkv_bias: bool
    max_positions: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 and cast back before the gain, as transformers' Llama/Qwen2 do.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


Rows = "slice | Tensor"  # cache rows of a batch: a slice (a view) or a (B,) index tensor (a gather)


class KVCache(nn.Module):
    """One row of K/V slots per sequence (`rows` of them), written at input positions."""

    replaced = 0  # K or V tensors assigned in place of a cache's own, any cache's (`Decoder.reset_cache`)

    def __init__(self, max_len: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device, rows: int = 1,
                 store: Tensor | None = None):
        """`store`: (2, rows, Hkv, S, D) zeros whose halves become k and v (views), else their own."""
        super().__init__()
        shape = (rows, n_kv_heads, max_len, head_dim)  # (rows, Hkv, S, D)
        if store is None:
            store = torch.zeros((2,) + shape, dtype=dtype, device=device)
        self.register_buffer("k", store[0], persistent=False)
        self.register_buffer("v", store[1], persistent=False)

    def __setattr__(self, name: str, value) -> None:
        if name in ("k", "v"):
            KVCache.replaced += 1
        super().__setattr__(name, value)

    def write(self, input_pos: Tensor, k: Tensor, v: Tensor, rows: Rows) -> None:
        """k/v (B, Hkv, T, D) into `rows` at input_pos ((T,) or (B, T))."""
        if isinstance(rows, slice):
            kc, vc = self.k[rows], self.v[rows]
            if input_pos.dim() == 1:
                kc.index_copy_(2, input_pos, k)
                vc.index_copy_(2, input_pos, v)
            else:  # per-sequence positions: element (b, t) goes to slot input_pos[b, t] of row b
                b = torch.arange(len(input_pos), device=input_pos.device)[:, None]
                kc[b, :, input_pos] = k.transpose(1, 2)  # indexed (B, T, Hkv, D)
                vc[b, :, input_pos] = v.transpose(1, 2)
            return
        pos = input_pos if input_pos.dim() == 2 else input_pos.expand(len(rows), -1)
        self.k[rows[:, None], :, pos] = k.transpose(1, 2)
        self.v[rows[:, None], :, pos] = v.transpose(1, 2)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor, rows: Rows, kv_len: int) -> tuple[Tensor, Tensor]:
        """`write`, then -> those rows' cache slots [0, kv_len) (gathered rows: a copy of just those)."""
        self.write(input_pos, k, v, rows)
        if isinstance(rows, slice):
            return self.k[rows, :, :kv_len], self.v[rows, :, :kv_len]
        return self.k[:, :, :kv_len].index_select(0, rows), self.v[:, :, :kv_len].index_select(0, rows)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        self.qkv_proj: nn.Linear | None = None  # set by fuse(): one matmul instead of three
        self.kv_cache: KVCache | None = None
        # a backend's attention for one query per sequence over cache rows 0..B-1 (after the cache
        # write): (kv_cache, q (B, H, 1, D), input_pos (B, 1)) -> (B, 1, H*D)
        self.one_query = None
        # a backend's attention for every other forward with a cache (after the write):
        # (kv_cache, q (B, H, T, D), input_pos (T,) or (B, T), rows) -> (B, T, H*D)
        self.many_queries = None

    def fuse(self) -> None:
        """Replace q/k/v by one projection with the concatenated weights (same results); idempotent."""
        if self.qkv_proj is not None:
            return
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        if hasattr(q, "cat"):  # a quantized Linear that knows how to stack its kind (backends/int4.py)
            self.qkv_proj = type(q).cat([q, k, v])
            del self.q_proj, self.k_proj, self.v_proj
            return
        fused = nn.Linear(q.in_features, q.out_features + 2 * k.out_features, bias=q.bias is not None,
                          device=q.weight.device, dtype=q.weight.dtype)
        fused.weight.data = torch.cat([q.weight, k.weight, v.weight])
        if q.bias is not None:
            fused.bias.data = torch.cat([q.bias, k.bias, v.bias])
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, dim) -> rotated q (B, H, T, D), rotated k and v (B, Hkv, T, D)."""
        B, T, _ = x.shape
        if self.qkv_proj is not None:
            nq, nk = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([nq, nk, nk], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, mask: Tensor | None, kv_len: int,
               rows: Rows | None = None) -> Tensor:
        """Write k/v at input_pos of cache `rows` (default the first B), attend over cache slots
        [0, kv_len) -> (B, T, H*D) before o_proj."""
        B, _, T, _ = q.shape
        if self.kv_cache is not None:
            rows = slice(0, B) if rows is None else rows
            one = T == 1 and self.one_query is not None and isinstance(rows, slice) and not rows.start
            if one or self.many_queries is not None:  # a backend's attention reads the cache itself
                self.kv_cache.write(input_pos, k, v, rows)
                if one:
                    return self.one_query(self.kv_cache, q, input_pos)
                return self.many_queries(self.kv_cache, q, input_pos, rows)
            k, v = self.kv_cache.update(input_pos, k, v, rows, kv_len)
        if T == 1 and mask is not None:
            # One query: attend per KV head with the query heads of its group stacked, i.e. GQA
            # without repeating K/V (SDPA's masked GQA path repeats them and takes the math kernel).
            H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
            s = q.view(B, Hkv, H // Hkv, D) @ k.transpose(-1, -2) * D**-0.5  # (B, Hkv, H/Hkv, S)
            s = s.float().masked_fill(~mask, float("-inf"))  # mask (1|B, 1, 1, S)
            y = (s.softmax(-1).to(v.dtype) @ v).view(B, H, 1, D)  # (B, H, 1, D)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=self.n_kv_heads != self.n_heads)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv_heads != self.n_heads)
        return y.transpose(1, 2).reshape(B, T, -1)


class FeedForward(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.dim, c.intermediate, bias=False)
        self.up_proj = nn.Linear(c.dim, c.intermediate, bias=False)
        self.down_proj = nn.Linear(c.intermediate, c.dim, bias=False)
        self.gate_up_proj: nn.Linear | None = None  # set by fuse()

    def fuse(self) -> None:
        if self.gate_up_proj is not None:
            return
        g, u = self.gate_proj, self.up_proj
        if hasattr(g, "cat"):
            self.gate_up_proj = type(g).cat([g, u])
            del self.gate_proj, self.up_proj
            return
        fused = nn.Linear(g.in_features, 2 * g.out_features, bias=False, device=g.weight.device, dtype=g.weight.dtype)
        fused.weight.data = torch.cat([g.weight, u.weight])
        self.gate_up_proj = fused
        del self.gate_proj, self.up_proj

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = FeedForward(c)
        self.input_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.post_attention_layernorm = RMSNorm(c.dim, c.norm_eps)

    # The layer is split around attention so that a backend can compile the two halves, whose
    # shapes never change, and keep the KV-length-dependent attention out of the compiled code.
    def pre_attention(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

    def post_attention(self, x: Tensor, y: Tensor) -> Tensor:
        x = x + self.self_attn.o_proj(y)
        return x + self.mlp(self.post_attention_layernorm(x))



class Decoder(nn.Module):
    def __init__(self, c: DecoderConfig, vocab_size: int | None = None):
        super().__init__()
        self.config = c
        self.embed_tokens = Embedding(vocab_size, c.dim) if vocab_size else None
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.rope_cos: Tensor | None = None
        self.rope_sin: Tensor | None = None

    def setup_rope(self, max_len: int, device) -> None:
        """Tables of cos/sin per position, computed in float32 like transformers' rotary embedding."""
        d = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
        freqs = torch.arange(max_len, device=device).float()[:, None] * inv_freq[None, :]  # (S, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (S, D)
        self.rope_cos, self.rope_sin = emb.cos(), emb.sin()

    def setup_cache(self, max_len: int, dtype: torch.dtype, device, rows: int = 1) -> None:
        """A KV cache of `rows` sequences of max_len slots each, every layer's K and V views of one
        tensor (`kv_store`: layers, 2, rows, Hkv, S, D), so that a row is zeroed in one op."""
        c = self.config
        self.kv_store = torch.zeros((len(self.layers), 2, rows, c.n_kv_heads, max_len, c.head_dim), dtype=dtype,
                                    device=device)
        for layer, store in zip(self.layers, self.kv_store):
            layer.self_attn.kv_cache = KVCache(max_len, c.n_kv_heads, c.head_dim, dtype, device, rows, store)
        self._kv_replaced = KVCache.replaced

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        store, first = getattr(self, "kv_store", None), self.layers[0].self_attn.kv_cache
        if store is not None and (first is None or first.k.data_ptr() != store.data_ptr()):
            self.kv_store = None  # (moved: every cache is a copy now; the old store is not kept alive)
        return out

    def fuse(self) -> None:
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def reset_cache(self, row: int | slice | None = None) -> None:
        """Zero the cache (one row of it, or a run of rows, when given): as one op on `kv_store` while
        every layer's K and V are still its views (one launch; a few where the row spans more than 2
        GB), else layer by layer (a module moved with `to` has copies; a cache may have been given
        other tensors)."""
        store = getattr(self, "kv_store", None)
        if store is not None and KVCache.replaced == self._kv_replaced:  # (no K or V assigned since: O(1))
            (store if row is None else store[:, :, row]).zero_()
            return
        for layer in self.layers:
            if layer.self_attn.kv_cache is not None:
                c = layer.self_attn.kv_cache
                (c.k if row is None else c.k[row]).zero_()
                (c.v if row is None else c.v[row]).zero_()

    def forward(self, x: Tensor, input_pos: Tensor, mask: Tensor | None = None, kv_len: int = 0,
                block_fns: tuple | None = None, rows: Rows | None = None) -> Tensor:
        """`block_fns` = (pre_attention, post_attention) replacements, e.g. compiled versions of
        Block's own methods, called as fn(layer, ...). `rows`: the cache rows of the B sequences."""
        if self.rope_cos is None or self.rope_cos.device != x.device:
            self.setup_rope(self.config.max_positions, x.device)
        cos = self.rope_cos[input_pos].to(x.dtype)  # (T, D) or (B, T, D)
        sin = self.rope_sin[input_pos].to(x.dtype)
        cos, sin = (cos[None, None], sin[None, None]) if input_pos.dim() == 1 else (cos[:, None], sin[:, None])
        pre, post = block_fns or (Block.pre_attention, Block.post_attention)
        with sdpa_kernel(SDPA_BACKENDS):
            for layer in self.layers:
                q, k, v = pre(layer, x, cos, sin)
                x = post(layer, x, layer.self_attn.attend(q, k, v, input_pos, mask, kv_len, rows))
        return self.norm(x)


def causal_mask(input_pos: Tensor, kv_len: int) -> Tensor:
    """(1, 1, T, kv_len) boolean: query at position p sees cache slots 0..p."""
    slots = torch.arange(kv_len, device=input_pos.device)
    return (slots[None, :] <= input_pos[:, None])[None, None]
