"""Every kernel launch of the full-size model compiled for each GPU architecture, without a GPU, and
checked against that architecture's limits (backends/kernels/targets.py). tests/test_targets.py
runs it; by hand:

    python tools/kernel_targets.py                     # every target, a table of what each kernel uses
    python tools/kernel_targets.py --targets 86,120 --jobs 2 --json /tmp/targets.json

How: the launch code itself runs, on meta tensors at the model's full size (MiniCPM-o 2.6: the
Qwen2.5-7B LLM, the ChatTTS head; one layer of each, as every layer launches the same), with
`targets.planning` set to the architecture and Triton's driver replaced by one that reports it:
each launch reaches Triton's JIT, which binds its arguments as for a GPU and asks to compile; the
request (kernel, signature, constants, options) is recorded instead and nothing runs. So what is
compiled is what the launch sites launch, configurations chosen by capability included. The
recorded kernels are then compiled for the architecture (Triton's compiler and its ptxas) in
worker processes, and each one's shared memory (Triton's metadata, plus the static shared memory
of the CUBIN), registers and local memory (cuobjdump's resource usage) and threads are checked:
shared memory within the block's opt-in limit, registers at most 255 a thread and, allocated per
warp in units of 256, 64 K a block, at most 1024 threads, griddepcontrol (programmatic dependent
launch) only from sm_90 on. backends/q4_decode.cu (the int4 decode step's gate/up) is compiled by
NVRTC (backends/cuda.py's own call, `--gpu-architecture=sm_XX`) with the constants its launch
asks for, and checked the same way, its shared memory static (48 KB at most).

Token counts: the products' configurations change with the number of tokens (rows of a batch,
prompt lengths); the sweep launches each at the counts where a choice changes (`TOKENS`), and
int4's prefill product at every count up to 512. KV rows do not change a kernel's constants.

Needs: Triton (ptxas and cuobjdump come with it); for q4_decode.cu, NVRTC (the nvidia-cuda-nvrtc
wheel, in the test extra); a CPU build of torch is enough. Must not run under TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOKENS = (1, 2, 3, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 1024)  # where a product's configuration may change
ROWS = (1, 2, 3, 16, 64, 128)  # batched steps: rows of a batch (the TTS's steps, the LLM's tokens)
DTYPES = ("bfloat16", "float32")  # --dtype on a GPU


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

    @property
    def key(self) -> tuple:
        return self.module, self.name, self.signature, self.constexprs, self.options

    def label(self) -> str:
        opts = dict(self.options)
        consts = ",".join(f"{v}" for _, v in self.constexprs)
        return f"{self.name}[w{opts.get('num_warps')},s{opts.get('num_stages')}]({consts})"


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


def record(cc: tuple[int, int], dtypes=DTYPES) -> tuple[list[Launch], list[tuple]]:
    """(Triton launches, q4_decode.cu constants) of every launch site at full size for capability cc."""
    import torch
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from minicpm_cli.backends.kernels import decode, targets

    launches: dict[tuple, Launch] = {}
    cuda_defines: set[tuple] = set()
    where = ["?"]

    def do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        opts = {k: v for k, v in options.__dict__.items() if k in ("num_warps", "num_stages", "num_ctas", "launch_pdl",
                                                                  "maxnreg", "enable_fp_fusion")}
        fn = self.fn
        launch = Launch(fn.__module__, fn.__name__, _freeze(signature), _freeze(sorted(constexprs.items())),
                        _freeze(sorted(attrs.items())), _freeze(opts), where[0])
        launches.setdefault(launch.key, launch)
        return None  # nothing compiled, nothing launched

    def gate_up(w, x, gain, h, eps, *, warps=4, chunks=2, stages=2, pdl=False):
        cuda_defines.add(decode.gate_up_defines(w, warps, chunks, stages, pdl))

    saved = JITFunction._do_compile, decode.cuda_gate_up, driver._active
    JITFunction._do_compile, decode.cuda_gate_up = do_compile, gate_up
    driver.set_active(_fake_driver(cc))
    try:
        with targets.planning(cc), torch.inference_mode():
            for dtype in dtypes:
                for site, fn in _sites(getattr(torch, dtype)):
                    where[0] = f"{site} ({dtype})"
                    fn()
    finally:
        JITFunction._do_compile, decode.cuda_gate_up, driver._active = saved  # (no GPU: no default driver)
    return list(launches.values()), sorted(cuda_defines)


def _sites(dtype):
    """(name, callable) for every launch site, on meta tensors of the full-size model."""
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
    spec = dataclasses.replace(SyntheticSpec.full(), layers=1, tts_layers=1)
    config = RandomCheckpoint(spec).config  # (config.json of the official layout at these sizes)
    rows = max(ROWS)

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

    def prepared(decoder, max_len):
        decoder.fuse()
        decoder.setup_cache(max_len, dtype, meta, rows)
        decoder.setup_rope(decoder.config.max_positions, meta)
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

    def tts_steps():  # GraphTTSRunner: the single step, the batched steps on both kernels, the code heads
        m = tts()
        c = m.config
        vis = empty(tts_len, dt=torch.long)
        single = TritonDecode(prepared(m.model, tts_len), vis)
        pos = empty(1, dt=torch.long)
        tables = empty(c.num_vq, c.num_audio_tokens, c.decoder.dim)
        for nb in ROWS:  # the step's input (the single step's and a batch's)
            embed_codes(empty(nb, c.num_vq, dt=torch.long), tables, empty(nb, 1, dt=torch.bool),
                        empty(c.decoder.dim), empty(nb, c.decoder.dim), pdl=single.pdl)
        h = rms_norm(single(empty(c.decoder.dim), pos), m.model.norm, empty(c.decoder.dim))
        heads = Weight(m.heads.detach().view(c.num_vq * c.num_audio_tokens, -1))
        raw = empty(rows, c.num_vq, c.num_audio_tokens, dt=torch.float32)
        gemv(heads, h, raw[0].view(-1), **compiled.HEADS_GEMV, pdl=single.pdl)
        temps = empty(c.num_vq, dt=torch.float32)
        flags = empty(rows, 1, dt=torch.bool)
        codes = empty(rows, c.num_vq, dt=torch.long)
        for sampled in (False, True):
            sample_codes(raw[0], temps, flags[0], flags[0], raw[0] if sampled else None, raw[0], codes[0], c.top_p,
                         c.top_k, MIN_KEEP)
        vis_b = empty(rows, tts_len, dt=torch.long)
        kinds = [BatchDecode] + [MMADecode] * mma_fits(dtype, targets.capability(meta))  # (as GraphTTSRunner)
        for batch in [kind(single) for kind in kinds]:
            for nb in ROWS:
                y = batch(empty(nb, c.decoder.dim), empty(nb, dt=torch.long), vis_b)
                out = raw[:nb].view(nb, -1)
                if isinstance(batch, MMADecode):
                    batch.heads(heads, y, out)
                else:
                    gemv_rows(heads, y, out, **compiled.HEADS_GEMV, pdl=single.pdl)
                for sampled in (False, True):
                    sample_codes(raw[:nb], temps, flags[:nb], flags[:nb], raw[:nb] if sampled else None, raw[:nb],
                                 codes[:nb], c.top_p, c.top_k, MIN_KEEP)

    def invariant_llm():  # the batch-invariant mode (the default): products, norms, attention of the LLM
        m = llm()
        prepared(m.model, LLM_CONTEXT)
        invariant.make_invariant(m)
        invariant.invariant_tokens(m.model)
        _products(m, m.config.decoder.dim)
        attn = m.model.layers[0].self_attn
        c = m.config.decoder
        for nb in ROWS:
            attn.one_query(attn.kv_cache, empty(nb, c.n_heads, 1, c.head_dim), empty(nb, 1, dt=torch.long))
        for t in (1, 17, 300, 1024):
            attn.many_queries(attn.kv_cache, empty(2, c.n_heads, t, c.head_dim), empty(2, t, dt=torch.long), slice(0, 2))
        tokens = invariant.FusedTokens(m)  # (the token layer's element-wise kernels; its products are above)
        for nb in ROWS:
            tokens._kernels(empty(nb, dt=torch.long), empty(nb, dt=torch.long))
        layer, pos = m.model.layers[0], empty(2, 17, dt=torch.long)  # a prompt's layer halves (FusedPrompt)
        cos, sin = m.model.rope_cos[pos].to(dtype)[:, None], m.model.rope_sin[pos].to(dtype)[:, None]
        q, k, v = invariant.FusedPrompt._pre(layer, empty(2, 17, c.dim), cos, sin)
        invariant.FusedPrompt._post(layer, empty(2, 17, c.dim), empty(2, 17, c.n_heads * c.head_dim))

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

    def _products(model, dim):
        for mod in model.modules():
            if isinstance(mod, invariant.InvariantLinear):
                for t in TOKENS:
                    mod(empty(t, mod.in_features))
            elif isinstance(mod, invariant.InvariantRMSNorm):
                for t in (1, 17):
                    mod(empty(t, mod.weight.shape[0]))

    def int4():  # the int4 backend: its decode step, prefill products, batch-invariant products
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
        m.model.setup_cache(LLM_CONTEXT, dtype, meta, rows)
        m.model.setup_rope(c.max_positions, meta)
        step = TritonDecode(m.model)
        step(step.x, empty(1, dt=torch.long))
        for weight in w.values():
            seen = set()  # (the token counts that change the prefill product's configuration)
            for t in range(1, q4.MM_MAX_M + 2):
                cfg = q4.q4_mm_config(t, weight) if 1 < t <= q4.MM_MAX_M else t
                if cfg not in seen:
                    seen.add(cfg)
                    q4.q4_linear(empty(t, weight.k), weight, None)
            for t in TOKENS:
                q4.q4_invariant(empty(t, weight.k), weight, None)

    class _Q4(nn.Module):
        def __init__(self, weight, bias=None):
            super().__init__()
            self.weight_, self.bias = weight, bias

        def kernel_weight(self):
            return self.weight_

    yield "LLM decode step", llm_decode
    yield "TTS steps", tts_steps
    yield "LLM, batch-invariant", invariant_llm
    yield "TTS, batch-invariant", invariant_tts
    if dtype != torch.float32:  # (int4 runs in the model dtype bfloat16 on a GPU)
        yield "int4", int4


def _tool(name: str) -> str:
    import triton

    found = glob.glob(str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name))
    if not found:
        raise FileNotFoundError(f"{name} does not come with this Triton")
    return found[0]


def resources(cubin: bytes) -> dict:
    """REG, SHARED (static), LOCAL of a one-kernel CUBIN, from cuobjdump --dump-resource-usage."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    found = dict(re.findall(r"\b(REG|SHARED|LOCAL|STACK):(\d+)", out))
    return {k.lower(): int(v) for k, v in found.items()}


def check(cc: tuple[int, int], *, regs: int, threads: int, smem: int, smem_static: int, pdl: bool) -> list[str]:
    """What a kernel of these resources breaks of capability cc's limits (nothing: [])."""
    from minicpm_cli.backends.kernels import targets

    lim = targets.limits(cc)
    problems = []
    if smem + smem_static > lim.smem_block:
        problems.append(f"shared memory {smem + smem_static} B > {lim.smem_block} B a block")
    if smem_static > lim.smem_static:
        problems.append(f"static shared memory {smem_static} B > {lim.smem_static} B")
    if regs > lim.regs_thread:
        problems.append(f"{regs} registers a thread > {lim.regs_thread}")
    if threads > lim.threads_block:
        problems.append(f"{threads} threads > {lim.threads_block} a block")
    allocated = -(-regs // 8) * 8 * threads  # (registers are allocated per warp, in units of 256)
    if allocated > lim.regs_block:
        problems.append(f"{allocated} registers a block > {lim.regs_block}")
    if pdl and cc < targets.HOPPER:
        problems.append("programmatic dependent launch (griddepcontrol) before sm_90")
    return problems


def compile_triton(launch: Launch, cc: tuple[int, int]) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch.module), launch.name)
    start = time.perf_counter()
    src = ASTSource(fn, dict(launch.signature), dict(launch.constexprs), dict(launch.attrs))
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", cc[0] * 10 + cc[1], 32), options=dict(launch.options))
    except Exception as e:  # a compile error is a finding, not a crash of the sweep
        return {"kernel": launch.label(), "where": launch.where, "problems": [f"does not compile: {e}"[:500]],
                "seconds": time.perf_counter() - start}
    res = resources(kernel.asm["cubin"])
    threads = kernel.metadata.num_warps * 32
    pdl = "griddepcontrol" in kernel.asm["ptx"]
    return {"kernel": launch.label(), "where": launch.where, "smem": kernel.metadata.shared, "regs": res["reg"],
            "local": res.get("local", 0), "threads": threads, "pdl": pdl, "seconds": time.perf_counter() - start,
            "problems": check(cc, regs=res["reg"], threads=threads, smem=kernel.metadata.shared,
                              smem_static=res.get("shared", 0), pdl=pdl)}


def compile_cuda(defines: tuple, cc: tuple[int, int]) -> dict:
    from minicpm_cli.backends import cuda

    start = time.perf_counter()
    source = (ROOT / "backends" / "q4_decode.cu").read_text()
    d = dict(defines)
    label = "q4_rms_gate_up(" + ",".join(f"{k}={v}" for k, v in defines) + ")"
    try:
        cubin = cuda.compile_cubin(source, "q4_rms_gate_up", f"{cc[0]}{cc[1]}", tuple(f"-D{k}={v}" for k, v in defines))
    except Exception as e:
        return {"kernel": label, "where": "int4 decode (NVRTC)", "problems": [f"does not compile: {e}"[:500]],
                "seconds": time.perf_counter() - start}
    res = resources(cubin)
    threads = 32 * d["WARPS"]
    return {"kernel": label, "where": "int4 decode (NVRTC)", "smem": 0, "regs": res["reg"], "local": res.get("local", 0),
            "threads": threads, "pdl": bool(d["PDL"]), "seconds": time.perf_counter() - start,
            "problems": check(cc, regs=res["reg"], threads=threads, smem=0, smem_static=res.get("shared", 0),
                              pdl=bool(d["PDL"]))}


def _job(args):
    kind, item, cc = args
    return cc, (compile_triton if kind == "triton" else compile_cuda)(item, cc)


def sweep(ccs, jobs: int = 2, dtypes=DTYPES, nvrtc: bool = True, kernels: set[str] | None = None) -> dict:
    """{architecture name: [result of each distinct kernel]} and timings; `kernels`: compile only these
    (names of Triton kernels, q4_rms_gate_up for the CUDA C one), the rest only recorded."""
    from minicpm_cli.backends.kernels import targets

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("kernel_targets: unset TRITON_INTERPRET (the kernels must be JIT functions)")
    start = time.perf_counter()
    work, pdl = [], {}
    for cc in ccs:
        launches, defines = record(cc, dtypes)
        pdl[targets.limits(cc).name] = sorted({launch.name for launch in launches if dict(launch.options)["launch_pdl"]}
                                              | {"q4_rms_gate_up" for d in defines if dict(d)["PDL"]})
        work += [("triton", launch, cc) for launch in launches if kernels is None or launch.name in kernels]
        if nvrtc and (kernels is None or "q4_rms_gate_up" in kernels):
            work += [("cuda", d, cc) for d in defines]
    recorded = time.perf_counter() - start
    results: dict[str, list] = {targets.limits(cc).name: [] for cc in ccs}
    # (spawned workers: a fork of a process that has run torch may hang)
    import multiprocessing

    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for cc, result in pool.map(_job, work, chunksize=4):
            results[targets.limits(cc).name].append(result)
    return {"results": results, "record_seconds": recorded, "seconds": time.perf_counter() - start,
            "kernels": len(work), "pdl": pdl}


def main(argv=None) -> int:
    from minicpm_cli.backends.kernels import targets

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default=",".join(f"{a}{b}" for a, b in targets.TARGETS),
                   help="compute capabilities, e.g. 80,86,89,90,120")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--no-nvrtc", action="store_true", help="skip backends/q4_decode.cu")
    p.add_argument("--kernels", help="compile only these kernels (comma-separated names; all are recorded)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    ccs = [(int(t[:-1]), int(t[-1])) for t in a.targets.split(",")]
    out = sweep(ccs, a.jobs, tuple(a.dtypes.split(",")), not a.no_nvrtc,
                set(a.kernels.split(",")) if a.kernels else None)
    bad = 0
    for arch, results in out["results"].items():
        lim = targets.limits((int(arch[3:-1]), int(arch[-1])))
        print(f"\n{arch} ({lim.card}: {lim.smem_block} B shared a block)")
        for r in sorted(results, key=lambda r: -r.get("smem", 0)):
            flag = "; ".join(r["problems"]) or "ok"
            bad += bool(r["problems"])
            print(f"  {r.get('smem', '-'):>7} B {r.get('regs', '-'):>4} regs {r.get('local', 0):>5} B local  "
                  f"{r['kernel'][:90]}  [{r['where']}]  {flag}")
    print(f"\n{out['kernels']} compilations in {out['seconds']:.0f} s (recording {out['record_seconds']:.1f} s), "
          f"{bad} over a limit")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
