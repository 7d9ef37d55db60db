"""Every Triton kernel a launch site of ours asks to compile, found without a GPU: the launch code
itself runs on meta tensors of one layer of the model (the full-size MiniCPM-o 2.6, or the
checkpoint's own config.json), with `targets.planning` set to an architecture and Triton's driver
replaced by one that reports it. Each launch reaches Triton's JIT, which binds its arguments as for a
GPU and asks to compile; the request (kernel, signature, constants, options) is recorded instead and
nothing runs. So what is recorded is what the launch sites launch, configurations chosen by
capability included. tools/kernel_targets.py compiles the records for every architecture and checks
their resources; `precompile` compiles them side by side into Triton's cache before a first request.

Token counts: the products' configurations change with the number of tokens (rows of a batch,
prompt lengths); the sites launch each at the counts where a choice changes (`TOKENS`), and int4's
prefill product at every count up to its largest tile. KV rows do not change a kernel's constants.
The sites come in groups (`GROUPS`), so that a caller records only what one backend and mode runs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

# where a product's configuration may change (and 1 and 16n: Triton specialises an integer so)
TOKENS = (1, 2, 3, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 1024)
ROWS = (1, 2, 3, 16, 64, 128)  # batched steps: rows of a batch (the TTS's steps, the LLM's tokens)
DTYPES = ("bfloat16", "float32")  # --dtype on a GPU
# llm-invariant / tts-invariant: the batch-invariant mode's prompts, products and attention (the default
# on a GPU); llm-variant: compile's --batch-variant decode step; tts: the batched TTS steps (on the tensor
# cores where they fit, else row by row), which the batch-invariant mode runs for one stream too;
# tts-single: the --batch-variant one-stream step; tts-rows: the row-by-row batched steps where the
# tensor cores' fit (`batch_kernels="rows"`); int4-invariant / int4-variant: int4's 4-bit products in
# each mode (and its variant decode step)
GROUPS = ("llm-invariant", "tts-invariant", "llm-variant", "tts", "tts-single", "tts-rows", "int4-invariant",
          "int4-variant")


@dataclasses.dataclass(frozen=True)
class Launch:
    """A kernel launch as Triton's JIT asked to compile it: picklable, hashable by `key`."""

    module: str
    name: str
    signature: tuple
    constexprs: tuple
    attrs: tuple
    options: tuple
    where: str  # which launch site (for the report)
    # (signature, constexprs, attrs, options) exactly as the JIT passed them: Triton's cache key hashes
    # their printed forms, so a compilation that is to land where the JIT will look takes these
    raw: tuple = dataclasses.field(default=(), compare=False, repr=False)
    jit_key: str = dataclasses.field(default="", compare=False, repr=False)  # (the JIT's own key, printed)
    # recorded only for what a short read does not run (the LLM's decoding, a prompt over FIRST_TOKENS):
    # a helper compiles these after the others (a reply decodes only after its prompt)
    later: bool = dataclasses.field(default=False, compare=False)
    qualname: str = dataclasses.field(default="", compare=False)  # (the function's, as Triton's hooks name it)

    @property
    def key(self) -> tuple:
        return self.module, self.name, self.signature, self.constexprs, self.attrs, self.options

    def label(self) -> str:
        opts = dict(self.options)
        consts = ",".join(f"{v}" for _, v in self.constexprs)
        return f"{self.name}[w{opts.get('num_warps')},s{opts.get('num_stages')}]({consts})"


def compile_launch(launch: Launch, cc: tuple[int, int]):
    """`launch` compiled for capability cc (Triton's compiler, into its on-disk cache) from exactly
    what the JIT passed, so that it lands where the JIT will look -> Triton's compiled kernel."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch.module), launch.name)
    signature, constexprs, attrs, options = launch.raw
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", cc[0] * 10 + cc[1], 32),
                          options=options)


def _fake_driver(cc: tuple[int, int]):
    from triton.backends.compiler import GPUTarget

    class Driver:
        """Triton's driver for a GPU that is not there: the device number is the architecture, so
        that each keeps its own JIT caches."""

        def get_current_device(self):
            return cc[0] * 10 + cc[1]

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", cc[0] * 10 + cc[1], 32)

    return Driver()


def _freeze(v):
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


def record(cc: tuple[int, int], dtypes=DTYPES, groups=GROUPS, config: dict | None = None, sms: int | None = None,
           found=None, rows=ROWS) -> tuple[list[Launch], list[tuple]]:
    """(Triton launches, CUDA C kernels as (file, kernel, constants): q4_decode.cu's and q4_chain.cu's)
    of the launch sites of `groups` for capability cc, in the order the sites first launch them;
    `config`: the checkpoint's config.json (None: the full-size model's); `sms`: the GPU's
    multiprocessors (None: the representative card's, targets.py); `found(launch)`, if given, is
    called with each new launch as it is recorded; `rows`: the batch sizes to launch the batched
    sites at (a one-stream command: (1,))."""
    import torch
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from . import decode, q4, targets

    launches: dict[tuple, Launch] = {}
    cuda_defines: set[tuple] = set()
    where = ["?"]

    def do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        opts = {k: v for k, v in options.__dict__.items() if k in ("num_warps", "num_stages", "num_ctas", "launch_pdl",
                                                                  "maxnreg", "enable_fp_fusion")}
        fn = self.fn
        launch = Launch(fn.__module__, fn.__name__, _freeze(signature), _freeze(sorted(constexprs.items())),
                        _freeze(sorted(attrs.items())), _freeze(opts), where[0],
                        copy.deepcopy((signature, constexprs, attrs, dict(options.__dict__))), repr(key), _LATER[0],
                        fn.__qualname__)
        seen = launches.get(launch.key)
        if seen is None or (seen.later and not launch.later):  # (new, or wanted sooner than first recorded)
            launches[launch.key] = launch if seen is None else dataclasses.replace(seen, later=False)
            if found is not None:
                found(launches[launch.key])
        return None  # nothing compiled, nothing launched

    def gate_up(w, x, gain, h, eps, *, warps=4, chunks=2, stages=2, pdl=False):
        cuda_defines.add(("q4_decode.cu", "q4_rms_gate_up", decode.gate_up_defines(w, warps, chunks, stages, pdl)))

    def chain(x, w, bias, *, pdl=False, **shape):
        cuda_defines.add(("q4_chain.cu", "q4_chain", q4.chain_defines(x.shape[0], w, bias is not None, pdl, **shape)))
        return torch.empty(x.shape[0], w.n, dtype=x.dtype, device=x.device)

    saved = JITFunction._do_compile, decode.cuda_gate_up, q4.q4_chain, driver._active, torch.cat
    JITFunction._do_compile, decode.cuda_gate_up, q4.q4_chain, torch.cat = do_compile, gate_up, chain, _meta_cat(torch.cat)
    driver.set_active(_fake_driver(cc))
    try:
        with targets.planning(cc, sms), torch.inference_mode():
            for dtype in dtypes:
                for group, site, fn in _sites(getattr(torch, dtype), config, tuple(rows)):
                    if group in groups:
                        where[0] = f"{site} ({dtype})"
                        fn()
    finally:
        JITFunction._do_compile, decode.cuda_gate_up, q4.q4_chain, driver._active, torch.cat = saved  # (no GPU: no default driver)
    return list(launches.values()), sorted(cuda_defines)


_LATER = [False]  # (the sites being recorded are Launch.later's: the LLM's decoding, long prompts)
FIRST_TOKENS = 129  # prompts up to this many tokens are a short request's (a read of a sentence or two)


@contextlib.contextmanager
def _later(flag: bool = True):
    saved, _LATER[0] = _LATER[0], flag or _LATER[0]
    try:
        yield
    finally:
        _LATER[0] = saved


def import_sites() -> None:
    """Import what the launch sites need (torch, Triton, the kernels' and models' modules) now: a
    process that forks compiling workers before recording (precompile.py) hands them all of it.
    (`_sites` imports them before its first site: running it up to there is the same list.)"""
    import torch

    next(_sites(torch.bfloat16))


def _meta_cat(cat):
    """torch.cat, which on meta tensors (the weights' fusing) is a Python decomposition that imports
    torch._dynamo (1-5 s, most of a recording) for an empty tensor of the joined shape."""

    def meta_cat(tensors, dim=0, **kwargs):
        tensors = list(tensors)
        if kwargs or not tensors or not all(t.is_meta for t in tensors):
            return cat(tensors, dim, **kwargs)
        shape = list(tensors[0].shape)
        shape[dim] = sum(t.shape[dim] for t in tensors)
        return tensors[0].new_empty(shape)

    return meta_cat


def _sites(dtype, config: dict | None = None, rows: tuple[int, ...] = ROWS):
    """(group, name, callable) for every launch site, on meta tensors of one layer of the model
    `config` describes (None: the full-size model)."""
    import torch
    from torch import nn

    from minicpm_cli.backends import compile as compiled
    from minicpm_cli.backends import invariant
    from minicpm_cli.backends.kernels import q4
    from minicpm_cli.backends.kernels.batch import BatchDecode, gemv_rows
    from minicpm_cli.backends.kernels.common import Weight
    from minicpm_cli.backends.kernels.decode import TritonDecode
    from minicpm_cli.backends.kernels.embed import embed_codes
    from minicpm_cli.backends.kernels.matvec import gemv
    from minicpm_cli.backends.kernels import targets
    from minicpm_cli.backends.kernels.mma import MMADecode, mma_fits
    from minicpm_cli.backends.kernels.norm import rms_norm
    from minicpm_cli.backends.kernels.sampling import sample_codes
    from minicpm_cli.engine.pipeline import LLM_CONTEXT
    from minicpm_cli.engine.synthetic import RandomCheckpoint, SyntheticSpec
    from minicpm_cli.engine.tts import FRAMES_PER_CALL, MAX_FRAMES, MIN_KEEP
    from minicpm_cli.models.chattts import ChatTTS, TTSConfig
    from minicpm_cli.models.qwen2 import Qwen2Config, Qwen2LM

    meta = torch.device("meta")
    if config is None:
        spec = dataclasses.replace(SyntheticSpec.full(), layers=1, tts_layers=1)
        config = RandomCheckpoint(spec).config  # (config.json of the official layout at these sizes)
    else:  # (one layer of each: every layer launches the same)
        config = {**config, "num_hidden_layers": 1, "tts_config": {**config["tts_config"], "num_hidden_layers": 1}}
    sizes, rows = rows, max(rows)  # (the batch sizes; the rows of the caches)

    def empty(*shape, dt=dtype):
        return torch.empty(*shape, dtype=dt, device=meta)

    def llm():
        with meta:
            m = Qwen2LM(Qwen2Config.from_hf(config))
        m.to(dtype)
        return m

    def tts():
        with meta:
            m = ChatTTS(TTSConfig.from_hf(config["tts_config"]))
        m.to(dtype)
        return m

    def rope(decoder):
        # (the tables on the CPU, then as meta tensors: arithmetic on meta tensors runs torch's Python
        # references, whose first call imports torch._dynamo, 0.5 s of the helper's start)
        decoder.setup_rope(decoder.config.max_positions, "cpu")
        decoder.rope_cos, decoder.rope_sin = decoder.rope_cos.to(meta), decoder.rope_sin.to(meta)

    def prepared(decoder, max_len):
        decoder.fuse()
        decoder.setup_cache(max_len, dtype, meta, rows)
        rope(decoder)
        return decoder

    tts_cfg = TTSConfig.from_hf(config["tts_config"])
    tts_len = min(tts_cfg.decoder.max_positions, tts_cfg.condition_length + MAX_FRAMES + 2 * FRAMES_PER_CALL)

    def llm_decode():  # CompiledLLM._decode (--batch-variant)
        m = llm()
        step = TritonDecode(prepared(m.model, LLM_CONTEXT))
        pos = empty(1, dt=torch.long)
        rms_norm(step(step.x, pos), m.model.norm, empty(m.config.decoder.dim))
        gemv(Weight(m.lm_head.weight), empty(m.config.decoder.dim), empty(m.config.vocab_size, dt=torch.float32),
             **compiled.LM_HEAD_GEMV, pdl=step.pdl)

    def tts_parts():
        m = tts()
        c = m.config
        single = TritonDecode(prepared(m.model, tts_len), empty(tts_len, dt=torch.long))
        heads = Weight(m.heads.detach().view(c.num_vq * c.num_audio_tokens, -1))
        raw = empty(rows, c.num_vq, c.num_audio_tokens, dt=torch.float32)
        return m, c, single, heads, raw

    def step_ends(m, c, single, raw, nb):  # a step's input (its last codes' embeddings) and its choice of codes
        tables = empty(c.num_vq, c.num_audio_tokens, c.decoder.dim)
        embed_codes(empty(nb, c.num_vq, dt=torch.long), tables, empty(nb, 1, dt=torch.bool), empty(c.decoder.dim),
                    empty(nb, c.decoder.dim), pdl=single.pdl)
        temps, flags = empty(c.num_vq, dt=torch.float32), empty(rows, 1, dt=torch.bool)
        for sampled in (False, True):
            sample_codes(raw[:nb], temps, flags[:nb], flags[:nb], raw[:nb] if sampled else None, raw[:nb],
                         empty(nb, c.num_vq, dt=torch.long), c.top_p, c.top_k, MIN_KEEP)

    def tts_single():  # GraphTTSRunner's one-stream step on TritonDecode (--batch-variant)
        m, c, single, heads, raw = tts_parts()
        step_ends(m, c, single, raw, 1)
        h = rms_norm(single(empty(c.decoder.dim), empty(1, dt=torch.long)), m.model.norm, empty(c.decoder.dim))
        gemv(heads, h, raw[0].view(-1), **compiled.HEADS_GEMV, pdl=single.pdl)
        for sampled in (False, True):  # (the one-stream step's choice takes row 0's views)
            flag, temps = empty(1, dt=torch.bool), empty(c.num_vq, dt=torch.float32)
            sample_codes(raw[0], temps, flag, flag, raw[0] if sampled else None, raw[0],
                         empty(c.num_vq, dt=torch.long), c.top_p, c.top_k, MIN_KEEP)

    def tts_batched(rows_kernels: bool):  # GraphTTSRunner's batched steps (and the invariant one-stream step)
        m, c, single, heads, raw = tts_parts()
        mma = mma_fits(dtype, targets.capability(meta))  # (as GraphTTSRunner)
        if rows_kernels and not mma:
            return  # (the row-by-row kernels are the batched steps then: group "tts")
        batch = (MMADecode if mma and not rows_kernels else BatchDecode)(single)
        vis = empty(rows, tts_len, dt=torch.long)
        for nb in sizes:
            step_ends(m, c, single, raw, nb)
            h = rms_norm(batch(empty(nb, c.decoder.dim), empty(nb, dt=torch.long), vis), m.model.norm,
                         empty(nb, c.decoder.dim), pdl=single.pdl)
            out = raw[:nb].view(nb, -1)
            if isinstance(batch, MMADecode):
                batch.heads(heads, h, out)
            else:
                gemv_rows(heads, h, out, **compiled.HEADS_GEMV, pdl=single.pdl)

    def invariant_llm():  # the batch-invariant mode (the default): products, norms, attention of the LLM
        m = llm()
        prepared(m.model, LLM_CONTEXT)
        invariant.make_invariant(m)
        invariant.invariant_tokens(m.model)
        _products(m, m.config.decoder.dim, llm=True)
        attn = m.model.layers[0].self_attn
        c = m.config.decoder
        for nb in sizes:
            with _later():
                attn.one_query(attn.kv_cache, empty(nb, c.n_heads, 1, c.head_dim), empty(nb, 1, dt=torch.long))
        for t in (1, 17, 300, 1024):
            with _later(t == 1):
                attn.many_queries(attn.kv_cache, empty(2, c.n_heads, t, c.head_dim), empty(2, t, dt=torch.long),
                                  slice(0, 2))
        tokens = invariant.FusedTokens(m)  # (the token layer's element-wise kernels; its products are above)
        for nb in sizes:
            with _later():
                tokens._kernels(empty(nb, dt=torch.long), empty(nb, dt=torch.long))
        layer = m.model.layers[0]
        for b, t in ((1, 1), (1, 16), (1, 17), (2, 17)):  # a prompt's layer halves (FusedPrompt; the count of
            pos = empty(b, t, dt=torch.long)               # rotary rows is specialised: 1, 16n or other)
            cos, sin = m.model.rope_cos[pos].to(dtype)[:, None], m.model.rope_sin[pos].to(dtype)[:, None]
            with _later(t == 1):
                invariant.FusedPrompt._pre(layer, empty(b, t, c.dim), cos, sin)
                invariant.FusedPrompt._post(layer, empty(b, t, c.dim), empty(b, t, c.n_heads * c.head_dim))

    def invariant_tts():
        m = tts()
        prepared(m.model, tts_len)
        invariant.make_invariant(m)
        _products(m, m.config.decoder.dim)
        c = m.config.decoder
        hooks = invariant.PromptHooks(m.model)
        attn = hooks.layers[0][1]
        for t in (16, 64, 303):
            attn(m.model.layers[0].self_attn.kv_cache, empty(2, c.n_heads, t, c.head_dim), empty(2, t, dt=torch.long),
                 slice(0, 2))

    def _products(model, dim, llm=False):
        for mod in model.modules():
            if isinstance(mod, invariant.InvariantLinear):
                for t in TOKENS:  # (the LLM's: under 16 tokens its decoding, a read's prompt has more; the
                    # TTS's prompts come in chunks of a few tokens, all of them a short read's)
                    with _later(llm and (t < 16 or t > FIRST_TOKENS)):
                        mod(empty(t, mod.in_features))
            elif isinstance(mod, invariant.InvariantRMSNorm):
                for t in (1, 17):
                    mod(empty(t, mod.weight.shape[0]))
            elif isinstance(mod, invariant.InvariantUnitNorm):  # (the speaker vectors, one or a batch)
                mod(empty(1, dim))

    def int4_weights():
        m = llm()
        c = m.config.decoder
        layer = m.model.layers[0]
        shapes = {"qkv": ((c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.dim), "o": (c.dim, c.n_heads * c.head_dim),
                  "gate_up": (2 * c.intermediate, c.dim), "down": (c.dim, c.intermediate)}
        w = {k: Weight(empty((n + 3) // 4, k_ // 8, 4, dt=torch.int32), empty(n, 1, dt=torch.float32),
                       empty(n, 1, dt=torch.float32), k_) for k, (n, k_) in shapes.items()}
        layer.self_attn.qkv_proj = _Q4(w["qkv"], empty(shapes["qkv"][0]))
        layer.self_attn.o_proj = _Q4(w["o"])
        layer.mlp.gate_up_proj = _Q4(w["gate_up"])
        layer.mlp.down_proj = _Q4(w["down"])
        for name in ("q_proj", "k_proj", "v_proj"):
            delattr(layer.self_attn, name)
        for name in ("gate_proj", "up_proj"):
            delattr(layer.mlp, name)
        return m, w

    def int4_variant():  # the int4 backend with --batch-variant: its decode step, its prefill products
        m, w = int4_weights()
        m.model.setup_cache(LLM_CONTEXT, dtype, meta, rows)
        rope(m.model)
        step = TritonDecode(m.model)
        step(step.x, empty(1, dt=torch.long))
        for weight in w.values():
            seen = set()  # (the token counts that change the prefill product's configuration)
            for t in range(1, q4.MM_MAX_M + 2):
                cfg = q4.q4_mm_config(t, weight) if 1 < t <= q4.MM_MAX_M else t
                if cfg not in seen:
                    seen.add(cfg)
                    q4.q4_linear(empty(t, weight.k), weight, None)

    def int4_invariant():
        # the int4 backend's batch-invariant products, with q/k/v's bias: 1-8 tokens take q4_chain
        # where it is faster (in 1, 2, 4 or 8 token places: 4, 5, 8 and 9 reach the last two and the
        # Triton product beyond), launched plainly and, where the GPU has it, as a programmatic
        # dependent (the fused token's)
        for name, weight in int4_weights()[1].items():
            bias = empty(weight.n) if name == "qkv" else None
            for t in sorted({*TOKENS, 4, 5, 8, 9}):
                for pdl in sorted({False, targets.pdl(meta)}):
                    q4.q4_invariant(empty(t, weight.k), weight, bias, pdl=pdl)

    class _Q4(nn.Module):
        def __init__(self, weight, bias=None):
            super().__init__()
            self.weight_, self.bias = weight, bias

        def kernel_weight(self):
            return self.weight_

    # (the TTS's steps first: theirs take longest to compile, 1.2-1.7 s against about 1 s for a product,
    # and a helper's workers, compiling in this order, are done soonest with the longest begun first)
    yield "tts", "TTS steps, batched", lambda: tts_batched(False)
    yield "tts-single", "TTS step, one stream", tts_single
    yield "tts-rows", "TTS steps, row by row", lambda: tts_batched(True)
    yield "tts-invariant", "TTS, batch-invariant", invariant_tts
    yield "llm-invariant", "LLM, batch-invariant", invariant_llm
    yield "llm-variant", "LLM decode step", llm_decode
    if dtype != torch.float32:  # (int4 runs in the model dtype bfloat16 on a GPU)
        yield "int4-invariant", "int4, batch-invariant", int4_invariant
        yield "int4-variant", "int4", int4_variant


