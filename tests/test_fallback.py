"""A kernel that cannot run on the user's GPU (backends/kernels/fallback.py): its stage takes the
eager path, gives the eager path's output, and says so once. Kernels are made to fail as Triton
fails on a GPU without the shared memory they ask for (OutOfResources); without a GPU everything
runs in Triton's interpreter (conftest)."""

from __future__ import annotations

import pytest
import torch
from conftest import llm_eager_and_kernel_runs, tts_eager_and_kernel_runs

pytest.importorskip("triton")

from triton.runtime.errors import OutOfResources  # noqa: E402

from minicpm_cli.backends import invariant  # noqa: E402
from minicpm_cli.backends.gptq import Q4Linear, dequantize, quantize  # noqa: E402
from minicpm_cli.backends.kernels import decode, fallback, q4  # noqa: E402
from minicpm_cli.engine.pipeline import Synthesizer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU_NAME = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"  # (what the warning names)


class Failing:
    """Stands for a JIT kernel (`kernel[grid](...)`) whose compilation runs out of shared memory."""

    def __init__(self, name: str):
        self.fn = type(name, (), {})  # (what fallback.kernel_name finds on the traceback)
        self.fn.__name__ = name
        self.calls = 0

    def __getitem__(self, grid):
        return self.launch

    def launch(self, *args, **kwargs):
        self.calls += 1
        raise OutOfResources(232448, 101376, "shared memory")


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(fallback, "_warned", set())


def warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("minicpm: warning: kernel")]


@pytest.mark.parametrize("kernel", ["attention_kernel", "rms_gate_up"])
def test_tts_step_falls_back_to_eager_once(tiny_dir, monkeypatch, capsys, kernel):
    """A TTS step's kernel fails (before the first residual write, or after it): the frames and
    logits are the eager runner's, from the step's input as it came; one warning names the kernel
    and the device, and the kernel is not tried again."""

    failing = Failing(kernel)
    monkeypatch.setattr(decode, kernel, failing)
    s = Synthesizer.load(str(tiny_dir), backend="eager", device=DEVICE, dtype="float32")
    runs = tts_eager_and_kernel_runs(s, "Hello there, how are you?", DEVICE)
    (codes_e, raw_e), (codes_f, raw_f) = runs
    assert torch.equal(codes_e, codes_f)
    torch.testing.assert_close(raw_f, raw_e, rtol=1e-5, atol=1e-5)
    lines = warnings(capsys.readouterr().err)
    assert len(lines) == 1 and kernel in lines[0] and GPU_NAME in lines[0] and "shared memory" in lines[0]
    assert failing.calls == 1  # (the stage is eager from then on)


def test_llm_decode_falls_back_to_eager(tiny_dir, monkeypatch, capsys):
    """The LLM decode step's first kernel fails: the same tokens and logits as the eager backend."""
    monkeypatch.setattr(decode, "_rms_qkv_rope", Failing("_rms_qkv_rope"))
    runs = llm_eager_and_kernel_runs(tiny_dir, DEVICE, "Hello world", steps=4)
    (le, he), (lf, hf) = runs
    assert torch.equal(le.argmax(-1), lf.argmax(-1))
    torch.testing.assert_close(lf, le, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hf, he, rtol=1e-4, atol=1e-4)
    lines = warnings(capsys.readouterr().err)
    assert len(lines) == 1 and "_rms_qkv_rope" in lines[0] and "decode step" in lines[0]


def test_invariant_product_falls_back_to_linear(monkeypatch, capsys):
    """The batch-invariant product cannot run: InvariantLinear gives F.linear's output; once said."""
    failing = Failing("_invariant_mm")
    monkeypatch.setattr(invariant, "PRODUCTS", fallback.Fallback("the batch-invariant products"))
    monkeypatch.setattr(invariant, "invariant_mm", lambda *a, **k: failing[(1,)](*a))
    lin = torch.nn.Linear(32, 16)
    invariant.make_invariant(lin)
    x = torch.randn(5, 32)
    for _ in range(2):
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), rtol=0, atol=0)
    lines = warnings(capsys.readouterr().err)
    assert len(lines) == 1 and "_invariant_mm" in lines[0] and "batch-invariant products" in lines[0]
    assert failing.calls == 1


def test_a_stage_with_a_twin_says_it_keeps_its_output(capsys):
    """A stage whose stand-in gives the same output (int4's CUDA C one-token product, whose twin is
    the Triton product of the same bits) names it, and does not say it loses batch invariance."""
    from minicpm_cli.backends.cuda import KernelError

    stage = fallback.Fallback("the 4-bit one-token product in CUDA C", twin="Triton's kernel (the same bits)")
    for _ in range(2):
        assert stage.guard(lambda: (_ for _ in ()).throw(KernelError("no NVRTC", "q4_chain")), lambda: 7,
                           torch.device("cpu")) == 7
    lines = warnings(capsys.readouterr().err)
    assert len(lines) == 1 and "q4_chain" in lines[0], lines
    assert "on Triton's kernel (the same bits) from now on" in lines[0] and "not batch-invariant" not in lines[0]


def test_other_errors_are_not_swallowed(monkeypatch):
    """Only a kernel that cannot run on this GPU falls back: a bug of ours is raised as it is."""
    stage = fallback.Fallback("a stage")
    with pytest.raises(ValueError):
        stage.guard(lambda: (_ for _ in ()).throw(ValueError("ours")), lambda: 1, torch.device("cpu"))
    assert not stage.failed


@pytest.mark.parametrize("group_size,desc_act", [(-1, False), (32, True)])
def test_q4_eager_matches_dequantized(group_size, desc_act):
    """The 4-bit products' eager twin: x @ W^T + b with W dequantized by torch's own operations."""
    torch.manual_seed(0)
    w = torch.randn(40, 256) * 0.05
    g_idx = (torch.arange(256) // 32)[torch.randperm(256)] if desc_act else None
    t = quantize(w, group_size, g_idx=g_idx)
    bias = torch.randn(40)
    lin = Q4Linear(**t, bias=bias, dtype=torch.float32, device="cpu")
    x = torch.randn(3, 256)
    xp = x if lin.perm is None else x.index_select(1, lin.perm)
    ref = x @ dequantize(**t).T + bias
    torch.testing.assert_close(q4.q4_eager(xp, lin.kernel_weight(), lin.bias, rows=16), ref, rtol=1e-5, atol=1e-5)
