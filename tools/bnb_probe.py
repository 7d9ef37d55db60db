"""bitsandbytes on MiniCPM-o 2.6's LLM, next to our backends: why it is not a dependency.

The design card names bitsandbytes. This measures its two inference formats, LLM.int8() (8-bit,
`Linear8bitLt`) and NF4 (`Linear4bit`, bf16 compute), on the full-size Qwen2-7B LLM with random weights
on one GPU: the 196 decoder Linears swapped, as the library's users do, into our eager model. Reported:
decode ms a token (one token at a time over a 256-token context, the reply workload's shape; eager and,
where capture works, as one CUDA graph), prefill ms for 128 tokens, and the GPU memory the weights take.
The bf16 rows are the same model before the swap. Compare with `minicpm bench --backend int4,compile`
on the same machine (docs/dependencies.md holds the figures).

    python tools/bnb_probe.py [--formats bf16,int8,nf4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minicpm_cli.backends.eager import build  # noqa: E402
from minicpm_cli.models.transformer import causal_mask  # noqa: E402
from minicpm_cli.engine.synthetic import RandomCheckpoint, SyntheticSpec  # noqa: E402

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def swap(model: torch.nn.Module, fmt: str) -> None:
    """Every decoder Linear becomes a bitsandbytes one (weights quantized as they move to the GPU)."""
    import bitsandbytes as bnb

    for name, mod in list(model.named_modules()):
        for attr in LINEARS:
            lin = getattr(mod, attr, None)
            if not isinstance(lin, torch.nn.Linear):
                continue
            bias = lin.bias is not None
            w = lin.weight.data.to("cpu", torch.float16 if fmt == "int8" else torch.bfloat16)
            if fmt == "int8":
                new = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, bias=bias, has_fp16_weights=False,
                                          threshold=6.0)
                new.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
            else:
                new = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=bias, compute_dtype=torch.bfloat16,
                                        quant_type="nf4")
                new.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4")
            if bias:
                new.bias = torch.nn.Parameter(lin.bias.data.to("cpu", torch.bfloat16), requires_grad=False)
            setattr(mod, attr, new.to("cuda"))
            del lin
    gc.collect()
    torch.cuda.empty_cache()


def timed(fn, n: int) -> float:
    """Median milliseconds of n calls, each synchronised."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def probe(fmt: str, tokens: int) -> dict:
    ckpt = RandomCheckpoint(SyntheticSpec.full(), seed=0)
    model = build(ckpt, ckpt.config, device="cuda", dtype=torch.bfloat16)
    if fmt != "bf16":
        swap(model, fmt)
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated() / 2**30
    dev = torch.device("cuda")
    model.model.setup_cache(512, torch.bfloat16, dev)
    ctx = 256
    ids = torch.randint(0, 1000, (1, 128), device=dev)
    pos = torch.arange(128, device=dev)
    prefill = timed(lambda: model(ids, pos, causal_mask(pos, 128), 128), 5)
    one = torch.randint(0, 1000, (1, 1), device=dev)
    p1 = torch.tensor([ctx], device=dev)
    mask = causal_mask(p1, ctx + 1)
    step = lambda: model(one, p1, mask, ctx + 1)  # noqa: E731
    for _ in range(3):
        step()
    eager = timed(step, tokens)
    graph = None
    try:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            step()
        graph = timed(g.replay, tokens)
    except Exception as e:  # capture is what we ask of the library here; its failure is a finding
        graph = f"no capture ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
    out = {"format": fmt, "weights_gib": round(weights, 2), "prefill_128_ms": round(prefill, 2),
           "decode_ms": round(eager, 2), "decode_graph_ms": graph if isinstance(graph, str) else round(graph, 3),
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    del model
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="bf16,int8,nf4")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed (median)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # (a child process: one format, one row)
    args = ap.parse_args()
    if args.one:
        r = probe(args.formats, args.tokens)
        print(f"| {r['format']} | {r['weights_gib']} | {r['prefill_128_ms']} | {r['decode_ms']} | {r['decode_graph_ms']} | {r['peak_gib']} |",
              flush=True)
        return
    import bitsandbytes

    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | bitsandbytes {bitsandbytes.__version__}")
    print("| format | LLM weights on the GPU (GiB) | prefill 128 tokens (ms) | decode eager (ms/token) | decode CUDA graph (ms/token) | peak (GiB) |")
    print("|---|---|---|---|---|---|", flush=True)
    for fmt in args.formats.split(","):
        # a process per format: a failed graph capture leaves CUDA's RNG in capture mode for the rest
        # of its process, which would spoil the next format's figures
        subprocess.run([sys.executable, __file__, "--formats", fmt, "--tokens", str(args.tokens), "--one"], check=False)


if __name__ == "__main__":
    main()
