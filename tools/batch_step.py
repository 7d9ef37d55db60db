"""Time one batched TTS step per batch size: CUDA-graph replays of `GraphTTSRunner.run_batch` on
full-size random TTS weights (the ChatTTS head only: no LLM, no codec).

    python tools/batch_step.py [--nb 1 2 4 8 16] [--path kernels mma compiled] [--pos 600] [--sampled]
                               [--cfg '{"down": [4, 4, 16]}'] [--mma-cfg '{"down": [16, 256, 4, 4]}' ...]
                               [--check] [--check-tiles] [--json]

nb = 1 is the single-stream step (the Triton kernels) on the `kernels` and `compiled` paths; larger
nb run the batched Triton kernels (`kernels`, backends/kernels/batch.py), the tensor-core ones
(`mma`, backends/kernels/mma.py; at nb = 1 too) or the torch.compile'd layer halves with cuBLAS
(`compiled`, the path before them). Rows sit at positions pos, pos+1, ... with a full text mask.
Each figure is the median over --rounds rounds of --steps replays timed with CUDA events, after the
graph's capture and --warmup replays; the first run of a shape (Triton and torch.compile
compilation, capture) is reported apart. `--cfg` overrides `BatchDecode.cfg` entries (weight rows a
program, warps, step rows a program); `--mma-cfg`, `MMADecode.cfg` entries, one variant timed per
JSON. `--check-tiles` compares each variant's step outputs with the first variant's, each from the
cache rows the first one started from (the timed steps in between write others). `--check` also
compares each row's codes and raw logits with those of its step alone: the single step
(`kernels`), or the tensor-core step of one row (`mma`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from minicpm_cli.backends.compile import GraphTTSRunner
from minicpm_cli.backends.kernels.batch import BatchDecode
from minicpm_cli.engine.pipeline import build_tts
from minicpm_cli.engine.synthetic import RandomCheckpoint, SyntheticSpec


# --mma-cfg keys that set an MMADecode attribute, not a cfg entry: '{"many": {"gate_up": [64, 64, 8]}, "many_from": 1}'
ATTRS = ("many", "many_from")


def stepper(runner: GraphTTSRunner, nb: int, sampled: bool, mma: bool):
    """One batched step of rows 0..nb-1 as the runner replays it; for one row on `mma` the tensor-core
    step (the runner takes the single step for row 0 alone)."""
    if nb == 1 and mma:
        def step():
            runner.graphs.run(("batch", 1, sampled), lambda: runner.batch_step(1, runner.max_len, sampled))
            runner.advance(1)
        return step
    kv = max(runner.positions[:nb]) + 1
    return lambda: runner.run_batch(nb, kv, sampled)


def time_step(runner: GraphTTSRunner, nb: int, sampled: bool, mma: bool, steps: int, rounds: int,
              warmup: int) -> dict:
    step = stepper(runner, nb, sampled, mma)
    t = time.perf_counter()
    step()  # compiles and captures
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    for _ in range(warmup):
        step()
    per = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        per.append(start.elapsed_time(end) / steps)
    ms = statistics.median(per)
    return {"nb": nb, "ms": ms, "ms_per_row": ms / nb, "spread": max(per) - min(per), "first_s": first}


def setup_rows(runner: GraphTTSRunner, nb: int, pos: int) -> None:
    """Rows 0..nb-1 at positions pos.., each with a full text mask, taking part in the step."""
    c = runner.config
    for b in range(nb):
        runner.set_text_len_row(b, c.streaming_text_reserved_len - 1)
        runner.positions[b] = pos + b
    runner.ctl[:, :nb] = torch.tensor([[pos + b for b in range(nb)], [0] * nb, [1] * nb, [0] * nb])
    runner.noise_b.fill_(1.0)
    runner.last_b[:nb].zero_()  # (earlier steps left their codes: the same inputs each time)
    runner.bos_b[:nb].fill_(False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nb", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--path", choices=("kernels", "mma", "compiled"), nargs="+", default=["kernels", "mma"])
    ap.add_argument("--pos", type=int, default=600, help="row 0's position (303 is the first audio frame)")
    ap.add_argument("--sampled", action="store_true", help="draw codes with noise (default greedy)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--cfg", default=None, help="JSON: BatchDecode.cfg entries to override")
    ap.add_argument("--mma-cfg", nargs="+", default=["{}"], help="JSON: MMADecode.cfg entries, one variant each")
    ap.add_argument("--group", type=int, default=None, help="step rows a program at most, every kernel")
    ap.add_argument("--check", action="store_true", help="compare each row's codes with the single step's")
    ap.add_argument("--check-tiles", action="store_true", help="mma: compare each variant's step outputs (final norm, "
                    "logits, codes) with the first variant's at the same rows and cache contents, bit for bit")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    ckpt = RandomCheckpoint(SyntheticSpec.full())
    tts = build_tts(ckpt, ckpt.config, device=dev, dtype=dtype)
    rows = max(*args.nb, 2)  # (a runner of one row has no batched step)
    runner = GraphTTSRunner(tts, rows=rows, batch_kernels="mma")
    mma = runner.batch
    kernels = BatchDecode(runner.triton)
    if args.group:
        kernels.cfg = {k: (r, w, args.group) for k, (r, w, _) in kernels.cfg.items()}
    if args.cfg:
        kernels.cfg.update({k: tuple(v) for k, v in json.loads(args.cfg).items()})
    mma_cfg, many, many_from = dict(mma.cfg), dict(mma.many), mma.many_from
    runs = [(p, {}) for p in args.path if p != "mma"]
    runs += [("mma", json.loads(v)) for v in args.mma_cfg] if "mma" in args.path else []
    results, tiles_ref = [], {}
    single_done = False
    for path, cfg in runs:
        runner.graphs.graphs.clear()  # graphs are keyed by nb only
        runner.batch = {"kernels": kernels, "mma": mma}.get(path)
        runner.batch_kernels = "mma" if path == "mma" else "rows"
        mma.cfg = {**mma_cfg, **{k: tuple(v) for k, v in cfg.items() if k not in ATTRS}}
        mma.many = {k: tuple(v) for k, v in cfg.get("many", many).items()}
        mma.many_from = cfg.get("many_from", many_from)
        for nb in args.nb:
            if nb == 1 and path != "mma" and single_done:
                continue
            setup_rows(runner, nb, args.pos)
            if args.check_tiles and path == "mma":
                if nb not in tiles_ref:  # the first variant: the cache rows it starts from, its outputs
                    saved = caches(runner, nb)
                    tiles_ref[nb] = (saved, step_outputs(runner, nb, args.sampled))
                    out = tiles_ref[nb][1]
                else:  # from the same cache rows (the timed steps since wrote others)
                    set_caches(runner, tiles_ref[nb][0])
                    out = step_outputs(runner, nb, args.sampled)
                tiles_equal = all(torch.equal(a, b) for a, b in zip(tiles_ref[nb][1], out))
            r = time_step(runner, nb, args.sampled, path == "mma", args.steps, args.rounds, args.warmup)
            r["path"] = path if nb > 1 or path == "mma" else "single"
            single_done |= r["path"] == "single"
            if cfg:
                r["cfg"] = cfg
            if args.check_tiles and path == "mma":
                r["equal_first_variant"] = tiles_equal
            if args.check and (nb > 1 or path == "mma"):
                r["rows_equal_alone"] = check_rows(runner, nb, args.pos, args.sampled, path == "mma")
            results.append(r)
            if not args.json:
                extra = f"  rows equal alone: {r['rows_equal_alone']}" if "rows_equal_alone" in r else ""
                if "equal_first_variant" in r:
                    extra += f"  equal to the first variant: {r['equal_first_variant']}"
                extra += f"  cfg {json.dumps(cfg)}" if cfg else ""
                print(f"{r['path']:8s} nb {nb:3d}: {r['ms']:.3f} ms a step ({r['ms_per_row']:.3f} a row, spread "
                      f"{r['spread']:.3f}; first {r['first_s']:.1f} s){extra}", flush=True)
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype,
                          "pos": args.pos, "results": results}))


def caches(runner: GraphTTSRunner, nb: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A copy of every layer's K and V cache rows 0..nb-1."""
    return [(a.self_attn.kv_cache.k[:nb].clone(), a.self_attn.kv_cache.v[:nb].clone())
            for a in runner.model.model.layers]


def set_caches(runner: GraphTTSRunner, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Cache rows back as `caches` copied them."""
    for a, (k, v) in zip(runner.model.model.layers, saved):
        a.self_attn.kv_cache.k[: k.shape[0]].copy_(k)
        a.self_attn.kv_cache.v[: v.shape[0]].copy_(v)


@torch.inference_mode()
def step_outputs(runner: GraphTTSRunner, nb: int, sampled: bool) -> tuple:
    """One batched step of rows 0..nb-1 run eagerly from the rows as set (positions not advanced):
    final norm, raw logits and codes."""
    runner.batch_step(nb, runner.max_len, sampled)
    torch.cuda.synchronize()
    return runner.normed_b[:nb].clone(), runner.raw_b[:nb].clone(), runner.code_b[:nb].clone()


def check_rows(runner: GraphTTSRunner, nb: int, pos: int, sampled: bool, mma: bool) -> bool:
    """Each row's codes and raw logits of one batched step equal those of its step alone (its cache
    row copied to row 0 first; rows hold what earlier steps of this tool wrote): the single step, or
    under `mma` the tensor-core step of one row."""
    setup_rows(runner, nb, pos)
    runner.batch_step(nb, runner.max_len, sampled)
    codes, raw = runner.code_b[:nb].clone(), runner.raw_b[:nb].clone()
    layers = runner.model.model.layers
    saved = [(a.self_attn.kv_cache.k[0].clone(), a.self_attn.kv_cache.v[0].clone()) for a in layers]
    same = True
    for b in range(nb):
        for a in layers:
            a.self_attn.kv_cache.k[0].copy_(a.self_attn.kv_cache.k[b])
            a.self_attn.kv_cache.v[0].copy_(a.self_attn.kv_cache.v[b])
        runner.vis_b[0].copy_(runner.vis_b[b])
        runner.last_b[0].copy_(runner.last_b[b])
        runner.bos_b[0].copy_(runner.bos_b[b])
        runner.noise_b[0].copy_(runner.noise_b[b])
        runner.pos_t.fill_(pos + b)
        runner.block_eos_t.fill_(False)
        if mma:
            runner.ctl[:2, 0] = torch.tensor([pos + b, 0])
            runner.batch_step(1, runner.max_len, sampled)
        else:
            runner.run_step(sampled)
        same &= bool(torch.equal(runner.code_b[0], codes[b]) and torch.equal(runner.raw_b[0], raw[b]))
    for a, (k, v) in zip(layers, saved):
        a.self_attn.kv_cache.k[0].copy_(k)
        a.self_attn.kv_cache.v[0].copy_(v)
    return same


if __name__ == "__main__":
    main()
