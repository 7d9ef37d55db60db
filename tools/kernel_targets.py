"""Every kernel launch of the full-size model compiled for each GPU architecture, without a GPU, and
checked against that architecture's limits (backends/kernels/targets.py). tests/test_targets.py
runs it; by hand:

    python tools/kernel_targets.py                     # every target, a table of what each kernel uses
    python tools/kernel_targets.py --targets 86,120 --jobs 2 --json /tmp/targets.json

How: every launch site of the full-size model is recorded for the architecture without running
(backends/kernels/launches.py: the launch code on meta tensors, Triton's driver faked). The
recorded kernels are then compiled for the architecture (Triton's compiler and its ptxas) in
worker processes, and each one's shared memory (Triton's metadata, plus the static shared memory
of the CUBIN), registers and local memory (cuobjdump's resource usage) and threads are checked:
shared memory within the block's opt-in limit, registers at most 255 a thread and, allocated per
warp in units of 256, 64 K a block, at most 1024 threads, griddepcontrol (programmatic dependent
launch) only from sm_90 on. The CUDA C kernels (backends/q4_decode.cu, the int4 decode step's
gate/up; backends/q4_chain.cu, int4's batch-invariant one-token product) are compiled by NVRTC
(backends/cuda.py's own call, `--gpu-architecture=sm_XX`) with the constants their launches ask
for, and checked the same way, their shared memory static (48 KB at most).

Needs: Triton (ptxas and cuobjdump come with it); for the CUDA C kernels, NVRTC (the nvidia-cuda-nvrtc
wheel, in the test extra); a CPU build of torch is enough. Must not run under TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
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

from minicpm_cli.backends.kernels.launches import DTYPES, Launch, compile_launch, record  # noqa: E402


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
    start = time.perf_counter()
    try:
        kernel = compile_launch(launch, cc)
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


def compile_cuda(item: tuple, cc: tuple[int, int]) -> dict:
    from minicpm_cli.backends import cuda

    start = time.perf_counter()
    file, name, defines = item
    source = (ROOT / "backends" / file).read_text()
    d = dict(defines)
    label = f"{name}(" + ",".join(f"{k}={v}" for k, v in defines) + ")"
    try:
        cubin = cuda.compile_cubin(source, name, f"{cc[0]}{cc[1]}", tuple(f"-D{k}={v}" for k, v in defines))
    except Exception as e:
        return {"kernel": label, "where": "int4 (NVRTC)", "problems": [f"does not compile: {e}"[:500]],
                "seconds": time.perf_counter() - start}
    res = resources(cubin)
    threads = 32 * d["WARPS"]
    return {"kernel": label, "where": "int4 (NVRTC)", "smem": 0, "regs": res["reg"], "local": res.get("local", 0),
            "threads": threads, "pdl": bool(d["PDL"]), "seconds": time.perf_counter() - start,
            "problems": check(cc, regs=res["reg"], threads=threads, smem=0, smem_static=res.get("shared", 0),
                              pdl=bool(d["PDL"]))}


def _job(args):
    kind, item, cc = args
    return cc, (compile_triton if kind == "triton" else compile_cuda)(item, cc)


def sweep(ccs, jobs: int = 2, dtypes=DTYPES, nvrtc: bool = True, kernels: set[str] | None = None) -> dict:
    """{architecture name: [result of each distinct kernel]} and timings; `kernels`: compile only these
    (names of Triton kernels, q4_rms_gate_up and q4_chain for the CUDA C ones), the rest only recorded."""
    from minicpm_cli.backends.kernels import targets

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("kernel_targets: unset TRITON_INTERPRET (the kernels must be JIT functions)")
    start = time.perf_counter()
    work, pdl = [], {}
    for cc in ccs:
        launches, defines = record(cc, dtypes)
        pdl[targets.limits(cc).name] = sorted({launch.name for launch in launches if dict(launch.options)["launch_pdl"]}
                                              | {name for _, name, d in defines if dict(d)["PDL"]})
        work += [("triton", launch, cc) for launch in launches if kernels is None or launch.name in kernels]
        if nvrtc:
            work += [("cuda", item, cc) for item in defines if kernels is None or item[1] in kernels]
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
    p.add_argument("--no-nvrtc", action="store_true", help="skip the CUDA C kernels (backends/*.cu)")
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
