"""Batch invariance: the pieces that make a stream's arithmetic the same alone and in any batch.

On a GPU in bfloat16 a request used to speak otherwise in a batch than alone (0 of 16 benchmark
requests gave the same codes): cuBLAS chose its kernels by the batch's shape, the single stream ran
other kernels (GEMVs) than the batch, and the codec's convolutions rounded by batch size. The
compile and int4 backends now run one kind of arithmetic at every batch size (docs/design.md,
"Batch invariance"):

- every Linear of the LLM and the TTS (projections, lm_head, the TTS's speaker projector) runs
  `invariant_mm` (kernels/gemm.py): all of K summed in order by one program, never split, whatever
  the number of tokens; every RMSNorm, and the speaker vectors' L2 normalisation, a program a row
  (`make_invariant` swaps the modules' classes in place, weights untouched);
- an LLM token, alone or batched, is the same layer (in a CUDA graph per row count) with its
  attention on `attend_rows` (kernels/attention.py), which reads each row's position on the device
  and splits the cache slots the same way at every row count (`RowsAttention`); `FusedTokens` runs
  it in nine launches a layer, int4's counter fills aside (the eager layer's bits,
  kernels/token.py), the eager layer stays its twin; `FusedPrompt` runs a prompt's layer on the same
  fused kernels (the eager halves' bits);
- an LLM prompt (alone or padded into a batch, after a kept voice context or not) attends on
  `prompt_attend` (kernels/attention.py; `PromptAttention`): each query over its row's slots in
  blocks counted from slot 0, so the padding, the other rows and the KV length change no bit. SDPA's
  masked grouped-query path, used before, gave a prompt after a 112-token context other bits alone
  than in a batch of 4 on an H100 (voiced replies: 22/32 equal);
- the TTS's text prefills (causal too) attend on `prompt_attend` as well (`PromptHooks`); a
  continuation's carried frames, which see each other both ways, keep SDPA (one row at a time);
- int4's 4-bit projections run `q4_invariant` (kernels/q4.py): one split of K and one K-block for
  every token count, one token included;
- the TTS step runs the tensor-core kernels (kernels/mma.py) for one row too;
- the codec decodes streamed chunks and short segments in batches of exactly `CODEC_BATCH` rows
  (padding repeats a row), and longer segments each row alone (compile.GraphCodec): cuDNN picks its
  convolution algorithms by batch size, and at one size a row's output does not depend on its place
  or on the other rows;
- sampling draws from each stream's own generator, row by row, as before.

The cost against the batch-variant kernels (`--batch-variant`) is in docs/benchmarks.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
from torch import Tensor, nn

from minicpm_cli.models.chattts import UnitNorm
from minicpm_cli.models.transformer import Block, RMSNorm

from .eager import decode_batch
from .kernels.attention import attend_rows, prompt_attend
from .kernels.gemm import invariant_mm, warm
from .kernels import targets
from .kernels.fallback import Fallback
from .kernels.norm import add_rms_norm, rms_norm, unit_norm
from .kernels.token import rope_rows, rope_write, silu_mul

CODEC_BATCH = 8  # rows of every codec decode in the invariant mode
BLOCK_S, MAX_SPLITS = 64, 16  # attention's slots a block and splits a head (TritonDecode's)


# each kind of kernel here falls back to its eager twin on a GPU where it cannot run (kernels/fallback.py)
PRODUCTS = Fallback("the batch-invariant products")
TOKENS = Fallback("the batch-invariant token layer")
PROMPTS = Fallback("the batch-invariant prompt layer")
NORMS = Fallback("the batch-invariant norms")
ATTENTION = Fallback("the batch-invariant attention")


class InvariantLinear(nn.Linear):
    """An nn.Linear on `invariant_mm` (its weight and bias as they are)."""

    def forward(self, x: Tensor) -> Tensor:
        return PRODUCTS.guard(lambda: invariant_mm(x, self.weight, self.bias),
                              lambda: F.linear(x, self.weight, self.bias), x.device)


class InvariantRMSNorm(RMSNorm):
    """RMSNorm as one kernel (kernels/norm.py: a program a row, so a row's result is what it gets
    alone), which in a one-token layer also saves six of the eager module's seven launches."""

    def forward(self, x: Tensor) -> Tensor:
        def kernel():
            n = x.shape[-1]
            out = torch.empty_like(x)
            rms_norm(x.contiguous().view(-1, n), self, out.view(-1, n))
            return out

        return NORMS.guard(kernel, lambda: RMSNorm.forward(self, x), x.device)


class InvariantUnitNorm(UnitNorm):
    """The speaker vector's normalisation as one kernel, a program a row (kernels/norm.py): torch's
    reductions split a row otherwise at other row counts, so a batch's speaker vectors would not be
    what each gets alone."""

    def forward(self, x: Tensor) -> Tensor:
        def kernel():
            n = x.shape[-1]
            out = torch.empty_like(x)
            unit_norm(x.contiguous().view(-1, n), self.eps, out.view(-1, n))
            return out

        return NORMS.guard(kernel, lambda: UnitNorm.forward(self, x), x.device)


def make_invariant(module: nn.Module) -> None:
    """Every plain nn.Linear in `module` becomes an InvariantLinear, every RMSNorm an
    InvariantRMSNorm and a UnitNorm an InvariantUnitNorm, in place, weights untouched; a quantized
    Linear that has an invariant product of its own (`invariant`) is switched to it."""
    for m in module.modules():
        if type(m) is nn.Linear:
            m.__class__ = InvariantLinear
        elif type(m) is RMSNorm:
            m.__class__ = InvariantRMSNorm
        elif type(m) is UnitNorm:
            m.__class__ = InvariantUnitNorm
        elif hasattr(type(m), "invariant"):  # a 4-bit Linear (gptq.Q4Linear): its own invariant product
            m.invariant = True


def warm_products(module: nn.Module) -> None:
    """Compile `invariant_mm` for every configuration and weight shape of `module`'s
    InvariantLinears now (on a GPU; a batch would otherwise wait for each mid-run)."""
    shapes, quantized = {}, {}
    for m in module.modules():
        if isinstance(m, InvariantLinear) and m.weight.is_cuda:
            shapes.setdefault((tuple(m.weight.shape), m.weight.dtype), m.weight)
        elif getattr(m, "invariant", False):  # 4-bit: each tile of tokens is a compilation of its own
            quantized.setdefault((m.in_features, m.out_features), m)
    for w in shapes.values():
        warm(w)
    dtype = next((w.dtype for w in shapes.values()), torch.bfloat16)
    for m in quantized.values():
        for t in (1, 16, 17, 32, 33, 64, 65, 128, 129):  # (Triton compiles counts of 16k apart)
            m(torch.zeros(t, m.in_features, dtype=dtype, device=m.packed.device))


class RowsAttention:
    """The one-query attention of an LLM layer's batched token (`Attention.one_query`): query b of
    (B, H, 1, D) against cache row b up to its position, on `attend_rows`. Rows 0..B-1 only (the
    batched token runs over those)."""

    def __init__(self, kv_cache, n_heads: int):
        rows, hkv, self.max_len, d = kv_cache.k.shape
        self.h, self.d = n_heads, d
        self.splits = min(triton.cdiv(self.max_len, BLOCK_S), MAX_SPLITS)
        dev = kv_cache.k.device
        self.part = torch.zeros(rows * n_heads * self.splits * (d + 2), dtype=torch.float32, device=dev)
        self.count = torch.zeros(rows * n_heads, dtype=torch.int32, device=dev)

    def __call__(self, kv_cache, q: Tensor, input_pos: Tensor) -> Tensor:
        return ATTENTION.guard(lambda: self._kernel(kv_cache, q, input_pos),
                               lambda: _attend_eager(kv_cache, q, input_pos.reshape(-1, 1), slice(0, q.shape[0])),
                               q.device)

    def _kernel(self, kv_cache, q: Tensor, input_pos: Tensor, pdl: bool = False) -> Tensor:
        b = q.shape[0]
        q = q.reshape(b, self.h * self.d).contiguous()
        pos = input_pos.reshape(b).contiguous()
        y = torch.empty_like(q)
        attend_rows(q, kv_cache.k, kv_cache.v, None, pos, y, self.part, self.count, nb=b, heads=self.h,
                    splits=self.splits, block_s=BLOCK_S, pdl=pdl)
        return y[:, None]  # (B, 1, H*D)


class FusedTokens:
    """One token for each of cache rows 0..B-1 of `lm` (a Qwen2LM made invariant, its projections
    fused, `invariant_tokens` done) in nine launches a layer: the residual's addition with the next
    RMSNorm (`add_rms_norm`), q/k/v, the rotary embedding with the cache writes (`rope_write`),
    `attend_rows`, o, gate/up, SiLU * up (`silu_mul`), down (int4's split products add their
    counters' fills). Each output is bit for bit what the eager layer (`eager.decode_batch`) gives
    (subnormal products aside: libdevice flushes them to zero under Triton, torch keeps them; none
    arise at the model's scales), which stays its twin where a kernel cannot run."""

    def __init__(self, lm):
        self.lm, self.m = lm, lm.model
        first = self.m.layers[0].self_attn
        self.h, self.d = first.n_heads, first.head_dim
        # the layer's kernels launch as programmatic dependents of the one before (kernels/common.py)
        # where its products do: invariant_mm (5.68 -> 5.59 ms a 7B token on an H100), and int4's
        # 4-bit products where they run on q4_chain (one token; Triton's `_q4_mm` launches plainly,
        # and with all of them plain int4 measured 3.48 -> 3.52 ms)
        self.pdl = targets.pdl(self.m.embed_tokens.weight.device) and all(
            type(p) is InvariantLinear or getattr(p, "invariant", False) for layer in self.m.layers
            for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))

    @staticmethod
    def fits(lm) -> bool:
        """Whether `lm`'s layers are the ones this runs (q/k/v and gate/up fused, the invariant
        attention set up)."""
        d = lm.model.layers[0].self_attn.head_dim
        return d & (d - 1) == 0 and all(  # (rope_write takes a head's halves as power-of-two ranges)
            layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
            and isinstance(layer.self_attn.one_query, RowsAttention) for layer in lm.model.layers)

    def __call__(self, ids: Tensor, pos: Tensor, kv: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        """ids, positions (B,) -> (float32 logits (B, vocab), hidden (B, dim)), as `eager.decode_batch`."""
        return TOKENS.guard(lambda: self._kernels(ids, pos),
                            lambda: decode_batch(self.lm, ids, pos, kv, slots), ids.device)

    def _kernels(self, ids: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        m, b, pdl = self.m, len(ids), self.pdl
        x = F.embedding(ids, m.embed_tokens.weight)  # (B, dim): the residual stream, added to in place
        xn = torch.empty_like(x)
        rms_norm(x, m.layers[0].input_layernorm, xn, pdl=pdl)
        q = torch.empty(b, self.h * self.d, dtype=x.dtype, device=x.device)
        for i, layer in enumerate(m.layers):
            attn, mlp = layer.self_attn, layer.mlp
            rope_write(_product(attn.qkv_proj, xn, pdl), m.rope_cos, m.rope_sin, pos, q, attn.kv_cache, self.h,
                       pdl=pdl)
            y = attn.one_query._kernel(attn.kv_cache, q, pos, pdl=pdl)[:, 0]
            add_rms_norm(x, _product(attn.o_proj, y, pdl), layer.post_attention_layernorm, xn, pdl=pdl)
            gu = _product(mlp.gate_up_proj, xn, pdl)
            a = silu_mul(gu, torch.empty(b, gu.shape[1] // 2, dtype=x.dtype, device=x.device), pdl=pdl)
            add_rms_norm(x, _product(mlp.down_proj, a, pdl),
                         m.layers[i + 1].input_layernorm if i + 1 < len(m.layers) else m.norm, xn, pdl=pdl)
        return _product(self.lm.lm_head, xn, pdl).float(), xn


def _product(linear, x: Tensor, pdl: bool) -> Tensor:
    """A fused token's projection: with `pdl` an `InvariantLinear` as a programmatic dependent launch
    (the products' eager twin where their kernel cannot run, as `InvariantLinear`'s own), and an
    invariant 4-bit one (gptq.Q4Linear) as one where it runs on q4_chain; else as the module runs
    it."""
    if pdl and type(linear) is InvariantLinear:
        return PRODUCTS.guard(lambda: invariant_mm(x, linear.weight, linear.bias, pdl=True),
                              lambda: F.linear(x, linear.weight, linear.bias), x.device)
    if pdl and getattr(linear, "invariant", False):
        return linear(x, pdl=True)
    return linear(x)


class FusedPrompt:
    """The halves of an LLM layer for a prompt (`Decoder.forward`'s block_fns) in fewer launches than
    the eager `Block`'s, each output bit for bit its own: before the attention, the RMSNorm, q/k/v and
    the rotary embedding in place (`rope_rows`: one launch for ten); after it, o, the residual's
    addition with the next RMSNorm (`add_rms_norm`), gate/up, SiLU * up (`silu_mul`), down and the
    residual's second addition: six for eight. The residual stream x is never written in place (the
    sum goes into o's output: x + r and r + x are the same float), so the eager halves, which take
    over where a kernel cannot run, start from it as it was. The cache writes stay the attention's."""

    @staticmethod
    def pre(layer, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return PROMPTS.guard(lambda: FusedPrompt._pre(layer, x, cos, sin),
                             lambda: Block.pre_attention(layer, x, cos, sin), x.device)

    @staticmethod
    def post(layer, x: Tensor, y: Tensor) -> Tensor:
        return PROMPTS.guard(lambda: FusedPrompt._post(layer, x, y), lambda: Block.post_attention(layer, x, y), x.device)

    @staticmethod
    def _pre(layer, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        attn = layer.self_attn
        b, t, _ = x.shape
        h, hkv, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
        qkv = attn.qkv_proj(layer.input_layernorm(x))  # (B, T, (H + 2 Hkv) D)
        rope_rows(qkv.view(b * t, -1), cos.reshape(-1, d), sin.reshape(-1, d), h + hkv, d)
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
        return (q.view(b, t, h, d).transpose(1, 2), k.view(b, t, hkv, d).transpose(1, 2),
                v.view(b, t, hkv, d).transpose(1, 2))

    @staticmethod
    def _post(layer, x: Tensor, y: Tensor) -> Tensor:
        mlp, n, x = layer.mlp, x.shape[-1], x.contiguous()  # (the kernels take rows n apart)
        r = layer.self_attn.o_proj(y)  # (B, T, dim), fresh: it takes the sum x + r
        xn = torch.empty_like(x)
        add_rms_norm(r.view(-1, n), x.reshape(-1, n), layer.post_attention_layernorm, xn.view(-1, n))
        gu = mlp.gate_up_proj(xn)
        a = silu_mul(gu.view(-1, gu.shape[-1]), torch.empty(*gu.shape[:-1], gu.shape[-1] // 2, dtype=x.dtype,
                                                            device=x.device).view(-1, gu.shape[-1] // 2))
        return r.add_(mlp.down_proj(a.view(*gu.shape[:-1], -1)))

    @staticmethod
    def fns() -> tuple:
        return FusedPrompt.pre, FusedPrompt.post


class PromptAttention:
    """The attention of an LLM layer's other forwards (`Attention.many_queries`: prompts, alone or
    padded into a batch, a voice's turn, a row's own forward) on `prompt_attend`: each query against
    its sequence's cache row up to its position, in blocks of slots counted from slot 0, so that its
    result does not depend on the number of queries, the padding, the other sequences or the KV
    length (SDPA's masked grouped-query path does: on an H100 a prompt after a 112-token context
    came out otherwise alone than in a batch of 4)."""

    def __init__(self, kv_cache, n_heads: int):
        rows, hkv, _, self.d = kv_cache.k.shape
        self.h, self.group = n_heads, n_heads // hkv
        self.all_rows = torch.arange(rows, device=kv_cache.k.device)
        self.BLOCK_T, self.BLOCK_S = prompt_blocks(self.d, kv_cache.k.dtype, targets.capability(kv_cache.k.device))

    def __call__(self, kv_cache, q: Tensor, input_pos: Tensor, rows) -> Tensor:
        return ATTENTION.guard(lambda: self._kernel(kv_cache, q, input_pos, rows),
                               lambda: _attend_eager(kv_cache, q, input_pos, rows), q.device)

    def _kernel(self, kv_cache, q: Tensor, input_pos: Tensor, rows) -> Tensor:
        B, H, T, D = q.shape
        q = q if q.stride(3) == 1 else q.contiguous()
        rows = self.all_rows[rows] if isinstance(rows, slice) else rows.contiguous()
        starts = (input_pos[:, 0] if input_pos.dim() == 2 else input_pos[:1].expand(B)).contiguous()
        out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
        k, v = kv_cache.k, kv_cache.v
        prompt_attend[(triton.cdiv(T, self.BLOCK_T), H, B)](
            q, k, v, rows, starts, out, D**-0.5, T, q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2), out.stride(0), out.stride(1), out.stride(2),
            GROUP=self.group, D=D, BLOCK_T=self.BLOCK_T, BLOCK_S=self.BLOCK_S,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
        return out.view(B, T, H * D)


def _attend_eager(kv_cache, q: Tensor, input_pos: Tensor, rows) -> Tensor:
    """The eager twin of `RowsAttention` and `PromptAttention`: queries q (B, H, T, D) at positions
    input_pos ((T,) or (B, T)) against cache rows `rows` (a slice or indices), each up to its own
    position (SDPA) -> (B, T, H*D)."""
    B, H, T, D = q.shape
    k, v = kv_cache.k[rows], kv_cache.v[rows]  # (B, Hkv, S, D)
    pos = input_pos if input_pos.dim() == 2 else input_pos[None].expand(B, T)
    slots = torch.arange(k.shape[2], device=q.device)
    mask = (slots[None, None, :] <= pos[:, :, None])[:, None]  # (B, 1, T, S)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != H)
    return y.transpose(1, 2).reshape(B, T, H * D)


def prompt_blocks(d: int, dtype: torch.dtype, cc: tuple[int, int] | None) -> tuple[int, int]:
    """(queries, cache slots) a `prompt_attend` program takes for head size d on compute capability
    cc: 64 and 64, or 32 and 32 where their tiles (the queries', and two stages of keys and values,
    some 160 KB for float32 heads of 128) would not fit a block's shared memory. A machine always
    takes the same blocks, which is what batch invariance needs."""
    budget = targets.limits(cc).smem_block if cc is not None else 1 << 30
    size = torch.finfo(dtype).bits // 8
    return (64, 64) if (64 + 4 * 64) * d * size + 16 * 1024 <= budget else (32, 32)


class PromptHooks:
    """`PromptAttention` on each layer of `decoder` for the forwards inside `with` only: a backbone
    whose other forwards are not causal (the TTS's continuation frames) keeps SDPA for those."""

    def __init__(self, decoder):
        self.layers = [(layer.self_attn, PromptAttention(layer.self_attn.kv_cache, layer.self_attn.n_heads))
                       for layer in decoder.layers]

    def __enter__(self) -> None:
        for attn, hook in self.layers:
            attn.many_queries = hook

    def __exit__(self, *exc) -> None:
        for attn, _ in self.layers:
            attn.many_queries = None


def invariant_tokens(decoder) -> None:
    """Give each layer of `decoder` (with its KV cache set up) a `RowsAttention` for its one-query
    steps and a `PromptAttention` for the rest."""
    for layer in decoder.layers:
        attn = layer.self_attn
        attn.one_query = RowsAttention(attn.kv_cache, attn.n_heads)
        attn.many_queries = PromptAttention(attn.kv_cache, attn.n_heads)


def fixed_batches(codes: Tensor, decode, rows: int = CODEC_BATCH) -> Tensor:
    """codes (n, T, num_vq) -> `decode` of each, in batches of exactly `rows` (the last padded with
    copies of its first row) -> (n, samples)."""
    out = []
    for i in range(0, len(codes), rows):
        part = codes[i : i + rows]
        k = len(part)
        if k < rows:
            part = torch.cat([part, part[:1].expand(rows - k, -1, -1)])
        out.append(decode(part)[:k])
    return torch.cat(out) if len(out) > 1 else out[0]
