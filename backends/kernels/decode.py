"""The fused decode layer for one-token steps, `TritonDecode`: five kernels per layer instead of
some eighteen.

A decode step of a small model (the TTS head: 20 layers x 768) is bound by the latency of its
kernels, not by arithmetic or bandwidth, so the layer is fused into five launches:

1. `_rms_qkv_rope` (here): RMSNorm of the residual stream, the fused q/k/v projection (+ bias),
   rotary embedding at the current position, q to a scratch buffer and k/v straight into the KV
   cache;
2. `attention_kernel` (attention.py): single-query attention over cache slots 0..pos (the position is read
   on the device, so one CUDA graph serves every position), masked by per-slot "visible from"
   positions when given (the TTS chunk mask) or causally (the LLM); the slots are split over
   programs and merged by the last one to finish;
3. `_gemv` (matvec.py): o_proj, added to the residual stream in place;
4. `rms_gate_up` (here): RMSNorm, the fused gate/up projection and SiLU(gate) * up (for 4-bit
   bfloat16 weights on a GPU, `cuda_gate_up`: the same in CUDA C on the tensor cores, which
   Triton's code generation could not match, backends/q4_decode.cu);
5. `_gemv` again: down_proj, added to the residual stream.

The projections run the K loop of matvec.py, on dense or 4-bit weights (`Weight`, common.py). The
launch shapes of each kernel are in `TritonDecode.__init__` (`cfg`, from sweeps on an H200:
tools/decode_sweep.py).

Arithmetic is float32 inside a kernel; results are rounded to the model dtype where the eager code
rounds them (after each projection, around the rotary products, after the activation). The RMSNorm
before a projection is folded into it (the normalised input is not rounded on its own), so in bf16
the kernels differ from `minicpm_cli.models.transformer` by about its own rounding error; in float32
by summation order only.

Tests: tests/test_kernels.py (the step against the eager decoder in float32 and bfloat16, the TTS
and LLM runners on it), tests/test_int4_kernels.py (`test_fused_4bit_decode_matches_dequantized_model`;
on a GPU `test_cuda_gate_up_matches_float64`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from minicpm_cli.models.transformer import Decoder

from .attention import attention_kernel
from . import targets
from .common import SplitScratch, Weight, round_to, sm_count, wait_previous, split_k
from .matvec import first_block, k_loop, row_params, row_scale, row_totals, gemv


@triton.jit
def _rms_qkv_rope(x_ptr, nw_ptr, w_ptr, s_ptr, z_ptr, b_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr,
                  eps, max_len, DIM: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                  HAS_BIAS: tl.constexpr, Q4: tl.constexpr, GS: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_K: tl.constexpr, VW: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False,
                  PIPE: tl.constexpr = False):
    # program (head, j): rows j*BLOCK_R.. of the head's first half and the matching second-half
    # rows, which the rotation pairs up
    head = tl.program_id(0)
    j = tl.program_id(1)
    dtype = x_ptr.dtype.element_ty
    d = j * BLOCK_R + tl.arange(0, BLOCK_R)
    row0 = head * D + j * BLOCK_R
    r1 = row0 + tl.arange(0, BLOCK_R)
    r2 = r1 + D // 2
    every = r1 >= 0
    lim = (HQ + 2 * HKV) * D
    pre = first_block(w_ptr, row0, row0 + D // 2, lim, 0, DIM, BLOCK_R, BLOCK_K, Q4, True, PIPE)
    # before the wait: weights, and the position (written before the step's first kernel)
    sc1, z1 = row_params(s_ptr, z_ptr, r1, every, DIM, Q4, GS)
    sc2, z2 = row_params(s_ptr, z_ptr, r2, every, DIM, Q4, GS)
    b1, b2 = load_qkv_bias(b_ptr, r1, r2, HAS_BIAS)
    pos = tl.load(pos_ptr)
    c = round_to(tl.load(cos_ptr + pos * D + d), dtype)
    s = round_to(tl.load(sin_ptr + pos * D + d), dtype)
    wait_previous(PDL, False)  # (`k_loop` lets the next kernel in after the loop)
    acc1, acc2, ss, vz = k_loop(pre, w_ptr, s_ptr, z_ptr, row0, row0 + D // 2, lim, x_ptr, nw_ptr, 0, DIM, DIM,
                                 BLOCK_R, BLOCK_K, VW, Q4, GS, True, True, STAGES, PDL, PIPE)
    o1, o2 = qkv_out(acc1, acc2, ss, vz, sc1, z1, sc2, z2, b1, b2, c, s, head, eps, DIM, HQ, HKV, BLOCK_R,
                      HAS_BIAS, Q4, GS, dtype)
    qkv_store(o1, o2, d, head, pos, q_ptr, kc_ptr, vc_ptr, max_len, HQ, HKV, D)


@triton.jit
def load_qkv_bias(b_ptr, r1, r2, HAS_BIAS: tl.constexpr):
    """The q/k/v bias of rows r1 and r2 in float32 (0 without one)."""
    b1 = 0.0
    b2 = 0.0
    if HAS_BIAS:
        b1 = tl.load(b_ptr + r1).to(tl.float32)
        b2 = tl.load(b_ptr + r2).to(tl.float32)
    return b1, b2


@triton.jit
def qkv_out(acc1, acc2, ss, vz, sc1, z1, sc2, z2, b1, b2, c, s, head, eps, DIM: tl.constexpr, HQ: tl.constexpr,
             HKV: tl.constexpr, BLOCK_R: tl.constexpr, HAS_BIAS: tl.constexpr, Q4: tl.constexpr, GS: tl.constexpr,
             dtype: tl.constexpr):
    """`_rms_qkv_rope`'s rows from its K loop (paired rows of a half head): RMSNorm scale, bias,
    rounding, rotation by (c, s) for q and k heads -> (o1, o2); shared with the batched kernel."""
    inv = 1.0 / tl.sqrt(tl.sum(ss, 0) / DIM + eps)
    y1 = row_scale(row_totals(acc1, vz, z1, DIM, BLOCK_R, Q4, GS), sc1, DIM, Q4, GS) * inv
    y2 = row_scale(row_totals(acc2, vz, z2, DIM, BLOCK_R, Q4, GS), sc2, DIM, Q4, GS) * inv
    if HAS_BIAS:
        y1 += b1
        y2 += b2
    return rotate_pair(round_to(y1, dtype), round_to(y2, dtype), c, s, head, HQ, HKV, dtype)


@triton.jit
def rotate_pair(y1, y2, c, s, head, HQ: tl.constexpr, HKV: tl.constexpr, dtype: tl.constexpr):
    """Paired rows y1, y2 (d and d + D/2) of head `head`, rounded, rotated by (c, s) as the eager
    code rounds it if a q or k head -> (o1, o2); shared with the tensor-core kernels (mma.py)."""
    if head < HQ + HKV:  # q and k heads rotate: x * cos + rotate_half(x) * sin
        o1 = round_to(round_to(y1 * c, dtype) - round_to(y2 * s, dtype), dtype)
        o2 = round_to(round_to(y2 * c, dtype) + round_to(y1 * s, dtype), dtype)
    else:
        o1 = y1
        o2 = y2
    return o1, o2


@triton.jit
def qkv_store(o1, o2, d, head, pos, q_ptr, kc_ptr, vc_ptr, max_len, HQ: tl.constexpr, HKV: tl.constexpr,
               D: tl.constexpr):
    """Half-head rows d and d + D/2 of head `head`: q to its buffer, k and v into cache slot pos."""
    if head < HQ:
        base = q_ptr + head * D
    elif head < HQ + HKV:
        base = kc_ptr + ((head - HQ) * max_len + pos) * D
    else:
        base = vc_ptr + ((head - HQ - HKV) * max_len + pos) * D
    tl.store(base + d, o1.to(q_ptr.dtype.element_ty))
    tl.store(base + d + D // 2, o2.to(q_ptr.dtype.element_ty))


@triton.jit
def rms_gate_up(x_ptr, nw_ptr, w_ptr, s_ptr, z_ptr, h_ptr, eps, DIM: tl.constexpr, INTER: tl.constexpr,
                Q4: tl.constexpr, GS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                VW: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False, PIPE: tl.constexpr = False):
    """h[rows] = silu(gate) * up of RMSNorm(x), W = [gate; up] stacked (2 * INTER, DIM)."""
    row0 = tl.program_id(0) * BLOCK_R
    rows = row0 + tl.arange(0, BLOCK_R)
    rm = rows < INTER
    dtype = x_ptr.dtype.element_ty
    pre = first_block(w_ptr, row0, row0 + INTER, INTER, 0, DIM, BLOCK_R, BLOCK_K, Q4, True, PIPE)
    sc_g, z_g = row_params(s_ptr, z_ptr, rows, rm, DIM, Q4, GS)
    sc_u, z_u = row_params(s_ptr, z_ptr, rows + INTER, rm, DIM, Q4, GS)
    wait_previous(PDL, False)  # (`k_loop` lets the next kernel in after the loop)
    acc_g, acc_u, ss, vz = k_loop(pre, w_ptr, s_ptr, z_ptr, row0, row0 + INTER, INTER, x_ptr, nw_ptr, 0, DIM, DIM,
                                   BLOCK_R, BLOCK_K, VW, Q4, GS, True, True, STAGES, PDL, PIPE)
    h = gate_up_out(acc_g, acc_u, ss, vz, sc_g, z_g, sc_u, z_u, eps, DIM, BLOCK_R, Q4, GS, dtype)
    tl.store(h_ptr + rows, h.to(dtype), mask=rm)


@triton.jit
def gate_up_out(acc_g, acc_u, ss, vz, sc_g, z_g, sc_u, z_u, eps, DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                 Q4: tl.constexpr, GS: tl.constexpr, dtype: tl.constexpr):
    """`rms_gate_up`'s rows from its K loop: RMSNorm scale, rounding, silu(gate) * up (float32,
    before its rounding to the model dtype); shared with the batched kernel."""
    inv = 1.0 / tl.sqrt(tl.sum(ss, 0) / DIM + eps)
    g = round_to(row_scale(row_totals(acc_g, vz, z_g, DIM, BLOCK_R, Q4, GS), sc_g, DIM, Q4, GS) * inv, dtype)
    u = round_to(row_scale(row_totals(acc_u, vz, z_u, DIM, BLOCK_R, Q4, GS), sc_u, DIM, Q4, GS) * inv, dtype)
    return silu_mul(g, u, dtype)


@triton.jit
def silu_mul(g, u, dtype: tl.constexpr):
    """silu(g) * u of rounded g and u, silu rounded as the eager op's output (float32, before the
    product's rounding); shared with the tensor-core kernels (mma.py)."""
    return round_to(g / (1.0 + tl.exp(-g)), dtype) * u


def cuda_gate_up_fits(w: Weight, x: Tensor, chunks: int = 2) -> bool:
    """Whether `cuda_gate_up` takes this gate/up weight and input: one-group 4-bit, bfloat16 on a
    CUDA GPU with bfloat16 tensor-core products (compute capability 8.0 and later), K in `chunks`
    parts of whole 512-byte loads of a warp (as backends/q4_decode.cu asserts)."""
    cc = targets.capability(x.device)  # (a GPU's, or the one planned for: tools/kernel_targets.py)
    return (w.q4 and w.group == w.k and x.dtype == torch.bfloat16 and cc is not None and cc >= (8, 0)
            and chunks > 0 and w.k % (256 * chunks) == 0 and (w.n // 2) % 4 == 0)


def gate_up_defines(w: Weight, warps: int, chunks: int, stages: int, pdl: bool) -> tuple[tuple[str, int], ...]:
    """The compile-time constants (NVRTC -D) of backends/q4_decode.cu for `cuda_gate_up`."""
    return (("DIM", w.k), ("INTER", w.n // 2), ("WARPS", warps), ("CHUNKS", chunks), ("STAGES", stages),
            ("PDL", int(pdl)))


def cuda_gate_up(w: Weight, x: Tensor, gain: Tensor, h: Tensor, eps: float, *, warps: int = 4, chunks: int = 2,
                 stages: int = 2, pdl: bool = False) -> None:
    """`rms_gate_up` for a one-group 4-bit weight (`cuda_gate_up_fits`) on the CUDA C kernel of
    backends/q4_decode.cu: blocks of `warps` warps, as many as fit on the GPU at once, each warp
    walking its quads in `chunks` parts of K with `stages` of them loaded or in flight. Unlike
    `rms_gate_up`, the RMSNorm's output is rounded to bfloat16 before the product, as the eager
    layer rounds it."""
    from .. import cuda

    inter = w.n // 2
    k = cuda.kernel("q4_decode.cu", "q4_rms_gate_up", x.device, gate_up_defines(w, warps, chunks, stages, pdl))
    per_sm = k.blocks_per_sm(32 * warps)
    if per_sm == 0:
        raise cuda.KernelError(f"q4_rms_gate_up: a block of {warps} warps does not fit a multiprocessor", "q4_rms_gate_up")
    blocks = min(triton.cdiv(inter // 4, warps), sm_count(x.device) * per_sm)
    k((blocks,), 32 * warps, x, gain, w.w, w.scales, w.zeros, h, float(eps), pdl=pdl)


def decode_config(dim: int, q4: bool) -> dict:
    """`TritonDecode.cfg`, the launch shapes of its kernels for a model of width `dim` (4-bit
    weights: `q4`), the same on every GPU: per kernel (rows per program, K per iteration, warps,
    K-blocks whose loads are in flight at once[, programs per row block (split-K) for o and
    down][, 1: 4-bit words through Triton's pipelining, see `k_loop`]); the qkv
    kernel's rows are per half head. The best of a sweep on an H200 (docs/journal.md): a small model
    wants all of K in one iteration (latency), a large one more, shorter programs.
    "gate_up_cuda": (warps a block, chunks of K, stages) of `cuda_gate_up`, which a 4-bit bfloat16
    step on a GPU runs instead of `rms_gate_up` (`cuda_gate_up_fits`; 0: never). Every shape fits
    every architecture of targets.TARGETS as it is (tests/test_targets.py compiles them all)."""
    if q4:  # 4-bit (int4 backend): swept on the H200 like the others; the words through Triton's
        # pipelining, programs of one or two warps
        return {"qkv": (4, 1024, 2, 3, 1), "o": (4, 512, 1, 4, 1, 1), "gate_up": (8, 512, 1, 4, 1),
                "down": (8, 1024, 2, 4, 1, 1), "gate_up_cuda": (4, 2, 2)}
    if dim <= 1024:
        k = triton.next_power_of_2(dim)
        return {"qkv": (8, k, 4, 1), "o": (8, k, 4, 1, 1), "gate_up": (8, k, 4, 1), "down": (8, 1024, 4, 1, 1)}
    return {"qkv": (8, 512, 4, 1), "o": (4, 512, 4, 1, 1), "gate_up": (4, 256, 4, 1), "down": (2, 2048, 8, 1, 1)}


def launch_shape(shape: tuple, n: int) -> tuple:
    """A `TritonDecode.cfg` launch shape padded with zeros to n + 1 elements (the optional last ones,
    e.g. PIPE, 0 where absent)."""
    return tuple(shape) + (0,) * (n + 1 - len(shape))


def kernels_scratch(cfg: dict, wo: Weight, wdown: Weight, device) -> SplitScratch:
    """Split-K scratch for the o and down launches of `cfg` (sized up front: nothing is allocated
    while a graph is captured, and `cfg` may change before, as the sweeps do)."""
    scratch = SplitScratch(device)
    for name, w in (("o", wo), ("down", wdown)):
        r, k, _, _, sp = cfg[name][:5]
        sp = split_k(w.k, w.block_k(k), sp)[0]
        blocks = triton.cdiv(w.n, r)
        scratch.reserve(blocks * sp * r if sp > 1 else 0, blocks if sp > 1 else 0)
    return scratch


class TritonDecode:
    """One-token decode through a fused `Decoder` (q/k/v and gate/up fused, KV cache and rotary
    tables set up) with the five kernels of the module docstring. `__call__(x, pos)` takes the
    input embedding (dim,) and a 1-element position tensor and returns the last layer's residual
    stream (dim,), before the final norm, in a static buffer. Capturable in a CUDA graph: no host synchronisation, no
    position-dependent shapes. `visible_from` (slots,): a slot is seen from that position on
    (the TTS mask); None means causal. `pdl`: launch the kernels as programmatic dependents
    (`wait_previous`; the default on Hopper and later GPUs, never in Triton's interpreter)."""

    def __init__(self, decoder: Decoder, visible_from: Tensor | None = None, pdl: bool | None = None):
        c = decoder.config
        self.c, self.decoder, self.visible_from = c, decoder, visible_from
        first = decoder.layers[0]
        attn = first.self_attn
        if attn.qkv_proj is None or first.mlp.gate_up_proj is None or attn.kv_cache is None:
            raise ValueError("TritonDecode needs a fused decoder with a KV cache")
        if decoder.rope_cos is None:
            raise ValueError("TritonDecode needs the rotary tables (Decoder.setup_rope)")
        self.weights = [tuple(Weight.of(p) for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                      layer.mlp.gate_up_proj, layer.mlp.down_proj))
                        for layer in decoder.layers]
        self.max_len = attn.kv_cache.k.shape[2]
        dev, dt = attn.kv_cache.k.device, attn.kv_cache.k.dtype
        self.x = torch.zeros(c.dim, dtype=dt, device=dev)
        self.q = torch.zeros(c.n_heads * c.head_dim, dtype=dt, device=dev)
        self.y = torch.zeros(c.n_heads * c.head_dim, dtype=dt, device=dev)
        self.h = torch.zeros(c.intermediate, dtype=dt, device=dev)
        self.cfg = decode_config(c.dim, self.weights[0][0].q4)
        self.scratch = kernels_scratch(self.cfg, self.weights[0][1], self.weights[0][3], dev)
        self.pdl = targets.pdl(dev) if pdl is None else pdl
        self.block_s = 64
        self.max_splits = 16  # programs per head (each takes every 16th block of slots); sizes `part`
        self.attn_warps = 4
        # attention partials (output, max, sum) per head and split (at most max_splits, whatever
        # block_s), and per-head split counters
        self.part = torch.zeros(c.n_heads * self.max_splits * (c.head_dim + 2), dtype=torch.float32, device=dev)
        self.count = torch.zeros(c.n_heads, dtype=torch.int32, device=dev)

    def __call__(self, x: Tensor, pos: Tensor) -> Tensor:
        c, dec, cfg, pdl = self.c, self.decoder, self.cfg, self.pdl
        D, H, Hkv = c.head_dim, c.n_heads, c.n_kv_heads
        if x is not self.x:  # (the LLM embeds straight into self.x)
            self.x.copy_(x.reshape(-1))
        vis = self.visible_from if self.visible_from is not None else pos
        splits = min(triton.cdiv(self.max_len, self.block_s), self.max_splits)
        qr, qk, qw, qs, qp = launch_shape(cfg["qkv"], 4)
        qr = min(qr, D // 2)
        gr, gk, gw, gs, gp = launch_shape(cfg["gate_up"], 4)
        r_o, k_o, w_o, st_o, sp_o, p_o = launch_shape(cfg["o"], 5)
        r_d, k_d, w_d, st_d, sp_d, p_d = launch_shape(cfg["down"], 5)
        gc_warps, gc_chunks, gc_stages = launch_shape(cfg.get("gate_up_cuda", (0,)), 2)
        gc = gc_warps > 0 and cuda_gate_up_fits(self.weights[0][2], self.x, gc_chunks)
        for layer, (wqkv, wo, wgu, wdown) in zip(dec.layers, self.weights):
            a = layer.self_attn
            bias = a.qkv_proj.bias
            _rms_qkv_rope[(H + 2 * Hkv, D // 2 // qr)](
                self.x, layer.input_layernorm.weight, *wqkv.args(), bias if bias is not None else self.x,
                dec.rope_cos, dec.rope_sin, pos, self.q, a.kv_cache.k, a.kv_cache.v, layer.input_layernorm.eps,
                self.max_len, DIM=c.dim, HQ=H, HKV=Hkv, D=D, HAS_BIAS=bias is not None, Q4=wqkv.q4,
                GS=wqkv.group, BLOCK_R=qr, BLOCK_K=wqkv.block_k(qk), VW=wqkv.vw(qk), STAGES=qs, PDL=pdl,
                PIPE=bool(qp), num_warps=qw, launch_pdl=pdl)
            attention_kernel[(H, splits)](self.q, a.kv_cache.k, a.kv_cache.v, vis, pos, self.y, self.part, self.count,
                                 D**-0.5, self.max_len, SPLITS=splits, GROUP=H // Hkv, D=D,
                                 HAS_VIS=self.visible_from is not None, BLOCK_S=self.block_s,
                                 NB=triton.cdiv(self.max_len, self.block_s), PDL=pdl, num_warps=self.attn_warps,
                                 launch_pdl=pdl)
            gemv(wo, self.y, self.x, self.x, rows=r_o, block_k=k_o, warps=w_o, stages=st_o, split=sp_o,
                 scratch=self.scratch, pdl=pdl, pipe=bool(p_o))
            if gc:
                cuda_gate_up(wgu, self.x, layer.post_attention_layernorm.weight, self.h,
                             layer.post_attention_layernorm.eps, warps=gc_warps, chunks=gc_chunks, stages=gc_stages,
                             pdl=pdl)
            else:
                rms_gate_up[(triton.cdiv(c.intermediate, gr),)](
                    self.x, layer.post_attention_layernorm.weight, *wgu.args(), self.h,
                    layer.post_attention_layernorm.eps, DIM=c.dim, INTER=c.intermediate, Q4=wgu.q4, GS=wgu.group,
                    BLOCK_R=gr, BLOCK_K=wgu.block_k(gk), VW=wgu.vw(gk), STAGES=gs, PDL=pdl, PIPE=bool(gp),
                    num_warps=gw, launch_pdl=pdl)
            gemv(wdown, self.h, self.x, self.x, rows=r_d, block_k=k_d, warps=w_d, stages=st_d, split=sp_d,
                 scratch=self.scratch, pdl=pdl, pipe=bool(p_d))
        return self.x
