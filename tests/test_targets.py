"""The kernels compile for the GPUs people own (backends/kernels/targets.py): every launch of the
full-size model, compiled without a GPU for sm_80, sm_86, sm_89, sm_90 and sm_120, within each
architecture's limits (tools/kernel_targets.py does the work, in a process of its own: the kernels
must be JIT functions there, not the interpreter's).

The whole sweep (some 130 kernels an architecture, 15-30 CPU minutes each architecture when cold,
then cached on disk by Triton) is marked `targets` and left out of the default run: `python -m pytest -m targets
tests/test_targets.py`. The default run records every launch for every architecture (the launch
code runs under each capability, Hopper-only features only from sm_90) and compiles the CUDA C
kernel and the norm for each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from minicpm_cli.backends.invariant import prompt_blocks  # noqa: E402
from minicpm_cli.backends.kernels import targets  # noqa: E402
from minicpm_cli.backends.kernels.gemm import _smem, mm_config  # noqa: E402
from minicpm_cli.backends.kernels.mma import mma_config, mma_fits  # noqa: E402

TOOL = Path(__file__).resolve().parents[1] / "tools" / "kernel_targets.py"
ARCHS = {"sm_80", "sm_86", "sm_89", "sm_90", "sm_120"}


def test_limits_are_the_programming_guides():
    """Opt-in shared memory a block, from the guide's table; 255 registers, 64 K a block, 1024 threads."""
    smem = {cc: targets.limits(cc).smem_block for cc in targets.TARGETS}
    assert smem == {(8, 0): 166912, (8, 6): 101376, (8, 9): 101376, (9, 0): 232448, (12, 0): 101376}
    for cc in targets.TARGETS:
        lim = targets.limits(cc)
        assert (lim.regs_thread, lim.regs_block, lim.threads_block) == (255, 65536, 1024)
    assert targets.limits((8, 7)).smem_block == 166912 and targets.limits((10, 0)).smem_block == 232448
    assert targets.limits((12, 1)).smem_block == 101376  # (not in the table: its major's row below it)
    assert targets.limits((11, 0)).smem_block == 65536  # (no row of its major: the smallest, Turing's)
    assert targets.limits((7, 0)).smem_block == 98304 and targets.limits((7, 5)).smem_block == 65536
    assert targets.limits((7, 2)).smem_block == 98304 and targets.limits((6, 1)).smem_block == 65536


def test_capability_and_pdl_follow_the_plan():
    meta = torch.device("meta")
    assert targets.capability(meta) is None and not targets.pdl(meta)  # the interpreter
    for cc in targets.TARGETS:
        with targets.planning(cc):
            assert targets.capability(meta) == cc
            assert targets.pdl(meta) == (cc >= (9, 0))
            assert targets.sm_count(meta) == targets.limits(cc).sms


@pytest.mark.parametrize("cc", targets.TARGETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_product_configurations_fit_by_capability(cc, dtype):
    """`mm_config` gives up stages, then tiles, where a block's shared memory is smaller; on sm_90 the
    bfloat16 shapes are the H100's own (what the sweeps chose)."""
    size = torch.finfo(dtype).bits // 8
    for m in (1, 16, 17, 32, 33, 64, 128, 129, 512, 513, 4096):
        for n, k in ((4608, 3584), (3584, 3584), (3584, 18944), (37888, 3584), (151666, 3584)):
            bn, bt, bk, warps, stages = mm_config(m, n, k, cc, dtype)
            assert _smem(bn, bt, bk, stages, size, cc) <= targets.limits(cc).smem_block
            if cc == (9, 0) and dtype == torch.bfloat16:
                assert (bn, bt, bk, warps, stages) == mm_config(m, n, k, None)


def test_alternatives_are_chosen_by_capability():
    assert mma_config((9, 0))["gate_up"][0] == 32 and mma_config((8, 6))["gate_up"][0] == 16
    assert mma_config((8, 0)) == mma_config((9, 0))
    assert mma_fits(torch.bfloat16, (8, 6)) and mma_fits(torch.float32, (9, 0))
    assert not mma_fits(torch.float32, (8, 0)) and not mma_fits(torch.float32, (12, 0))
    assert prompt_blocks(128, torch.bfloat16, (8, 6)) == (64, 64)
    assert prompt_blocks(128, torch.float32, (8, 0)) == (32, 32) and prompt_blocks(128, torch.float32, (9, 0)) == (64, 64)


def sweep(tmp: Path, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = tmp / "targets.json"
    run = subprocess.run([sys.executable, str(TOOL), "--json", str(out), "--jobs", str(min(os.cpu_count() or 1, 4)),
                          *args], capture_output=True, text=True, env=env, timeout=3 * 3600)
    if not out.exists():
        pytest.fail(f"tools/kernel_targets.py failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return json.loads(out.read_text()) | {"stdout": run.stdout}


def problems(result: dict) -> list[str]:
    return [f"{arch}: {r['kernel']} [{r['where']}]: {'; '.join(r['problems'])}"
            for arch, results in result["results"].items() for r in results if r["problems"]]


def test_every_launch_is_planned_and_the_cuda_kernels_compile_everywhere(tmp_path):
    """Every launch site runs for every architecture (recorded, not compiled: the full sweep below);
    programmatic dependent launch only from sm_90; the CUDA C kernels (q4_decode.cu, q4_chain.cu)
    through NVRTC and the norm kernel compiled for each and within its limits."""
    from minicpm_cli.backends import cuda
    from minicpm_cli.errors import BackendError

    try:
        cuda._nvrtc()
    except BackendError:
        pytest.skip("no NVRTC here: pip install nvidia-cuda-nvrtc (in the test extra)")
    result = sweep(tmp_path, "--kernels", "q4_rms_gate_up,q4_chain,_rms_norm", "--dtypes", "bfloat16")
    assert set(result["results"]) == ARCHS
    assert not problems(result), problems(result)
    for arch, results in result["results"].items():
        names = {r["kernel"].split("(")[0].split("[")[0] for r in results}
        assert names == {"q4_rms_gate_up", "q4_chain", "_rms_norm"}, arch
        hopper = arch in ("sm_90", "sm_120")
        assert bool(result["pdl"][arch]) == hopper, arch  # every step kernel of the plan, or none
        assert all(r["pdl"] == hopper for r in results if r["kernel"].startswith("q4_rms_gate_up"))
        chain = [r["pdl"] for r in results if r["kernel"].startswith("q4_chain")]  # (plain, and as dependents on
        assert chain and (True in chain) == hopper and False in chain, arch       # Hopper: the fused token's)


@pytest.mark.targets
def test_every_kernel_fits_every_architecture(tmp_path):
    """The whole sweep: every Triton kernel the full-size model launches (LLM, TTS, batched rows 1-128,
    int4, batch-invariant products, bfloat16 and float32) and q4_decode.cu, for each architecture."""
    result = sweep(tmp_path)
    assert set(result["results"]) == ARCHS
    assert not problems(result), "\n".join(problems(result))
