"""Memory-aware defaults (minicpm_cli/engine/memory.py): the estimate, `--backend auto` by free GPU
memory, rows from the memory left, MINICPM_MEMORY_CAP; GPU memory is faked."""

from __future__ import annotations

import pytest

from minicpm_cli import backends as registry
from minicpm_cli.engine import memory
from minicpm_cli.errors import BackendError, OptionError

GB = memory.GB


def test_estimate_of_the_full_size_model():
    """bf16 LLM 15.2 GB, int4 about 5.5 GB, KV caches about 0.4 GB a row (LLM 28 layers x 2 x 4 KV heads
    x 128 x 2 bytes x 4096 slots, TTS 20 layers x 2 x 768 x 2 bytes x 2401 slots)."""
    z = memory._sizes()
    assert 7.5e9 < z["llm"] < 7.7e9
    assert z["kv"] == 2 * 2 * (28 * 4 * 128 * 4096 + 20 * 768 * 2401)
    compile_, int4 = memory.need("compile"), memory.need("int4")
    assert 16 * GB < compile_.fixed < 18 * GB and 6 * GB < int4.fixed < 8 * GB
    assert compile_.per_row == int4.per_row
    assert int4.fixed - memory.need("gguf").fixed < compile_.fixed - memory.need("gguf").fixed
    assert compile_.total(4) == compile_.fixed + 4 * compile_.per_row


@pytest.mark.parametrize("free_gb,want", [(79, "compile"), (23.5, "compile"), (15.5, "int4"), (11.5, "int4"),
                                          (8.0, "int4")])  # (an 8 GiB card, 8.6 GB, less its context)
def test_auto_chooses_by_free_memory(free_gb, want):
    assert registry.choose(None, "cuda", triton=True, free=int(free_gb * GB)) == want


def test_float32_is_counted_at_four_bytes():
    """--dtype float32 doubles the weights outside int4's 4-bit layers, and the caches: with 25 GB free
    the bf16 model fits and the float32 one (30 GB of LLM alone) does not, so auto takes int4."""
    wide, bf16 = memory.need("compile", dtype="float32"), memory.need("compile")
    assert wide.fixed - memory.OVERHEAD == 2 * (bf16.fixed - memory.OVERHEAD) and wide.per_row > bf16.per_row
    assert memory.need("compile", dtype="auto") == bf16
    assert registry.choose(None, "cuda", triton=True, free=25 * GB) == "compile"
    assert registry.choose(None, "cuda", triton=True, free=25 * GB, dtype="float32") == "int4"
    with pytest.raises(BackendError, match="float32 model .* or use --dtype bfloat16"):
        registry.choose(None, "cuda", triton=True, free=9 * GB, dtype="float32")
    with pytest.raises(OptionError, match=r"^backend 'compile' needs about 3\d\.\d GB"):
        memory.rows_for("compile", bf16.fixed + 4 * bf16.per_row + 1, 4, dtype="float32")


def test_auto_says_what_fits_when_nothing_does():
    with pytest.raises(BackendError, match=r"4\.0 GB of GPU memory are free.*int4.*--backend gguf"):
        registry.choose(None, "cuda", triton=True, free=4 * GB)
    assert registry.choose(None, "cuda", triton=True, free=None) == "compile"  # (not known: as before)
    assert registry.choose(None, "cuda", triton=True, gguf="m.gguf", free=1 * GB) == "gguf"
    assert registry.choose(None, "cpu", free=None) == "eager"


def test_rows_from_the_memory_left():
    need = memory.need("compile")
    assert memory.rows_for("compile", None) == 8 and memory.rows_for("compile", None, 3) == 3  # a CPU
    assert memory.rows_for("compile", 80 * GB) == memory.MAX_ROWS
    free = need.fixed + 5 * need.per_row + 1
    assert memory.rows_for("compile", free) == 5
    assert memory.rows_for("compile", free, 5) == 5
    with pytest.raises(OptionError, match=r"--batch 6 needs about .* use --batch 5 or --backend int4"):
        memory.rows_for("compile", free, 6)
    with pytest.raises(OptionError, match="try --backend int4"):
        memory.rows_for("compile", need.fixed - 1)
    with pytest.raises(OptionError, match=r"^backend 'compile' needs about .*: try --backend int4$"):
        memory.rows_for("compile", need.fixed - 1, 1)  # (`say`'s one row: no "--batch 1" it did not give)


def test_what_does_not_fit_names_a_smaller_backend_only():
    """Where not even one row fits, the hint is int4 only for a backend that needs more than int4;
    int4 and gguf (smaller) are told to free memory or run on the CPU."""
    for backend in ("int4", "gguf"):
        with pytest.raises(OptionError) as e:
            memory.rows_for(backend, memory.need(backend).fixed - 1, 1)
        assert "--backend int4" not in str(e.value) and "--device cpu" in str(e.value), backend
    free = memory.need("int4").fixed + 2 * memory.need("int4").per_row + 1
    with pytest.raises(OptionError, match=r"use --batch 2$"):
        memory.rows_for("int4", free, 3)


def test_gguf_takes_one_row():
    """gguf's LLM is one llama.cpp sequence: a batch over it has one row, whatever memory or --batch
    would give (more rows would only hold TTS caches no stream uses)."""
    assert memory.rows_for("gguf", 80 * GB) == 1 and memory.rows_for("gguf", 80 * GB, 8) == 1
    assert memory.rows_for("gguf", None) == 1


def test_memory_cap(monkeypatch):
    monkeypatch.delenv(memory.CAP, raising=False)
    assert memory.cap_bytes() is None
    monkeypatch.setenv(memory.CAP, "12")
    assert memory.cap_bytes() == 12 * GB
    for value in ("lots", "0", "-3", "nan", "inf", "1e400"):
        monkeypatch.setenv(memory.CAP, value)
        with pytest.raises(OptionError, match="MINICPM_MEMORY_CAP"):
            memory.cap_bytes()


def test_a_cuda_device_past_the_last_is_one_line(monkeypatch):
    import torch

    from minicpm_cli.engine.pipeline import resolve_device
    from minicpm_cli.errors import DeviceError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1) and resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(DeviceError, match=r"^--device cuda:2: this machine has 2 CUDA devices \(cuda:0 to cuda:1\)$"):
        resolve_device("cuda:2")


def test_a_capped_gpu_is_what_auto_and_rows_see(monkeypatch):
    """Under MINICPM_MEMORY_CAP a 80 GB GPU is an 8 GB one: int4, its rows from what is left; the cap
    goes to torch as the process's memory fraction."""
    import torch

    fractions = []
    monkeypatch.setenv(memory.CAP, "8")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (79 * GB, 80 * GB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"total_memory": 80 * GB}))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: fractions.append((f, device)))
    free = memory.available(torch.device("cuda"))  # (as users name it: torch's fraction needs the index)
    assert free == 8 * GB and fractions == [(0.1, torch.device("cuda", 0))]
    assert registry.choose(None, "cuda", triton=True, free=free) == "int4"
    assert memory.rows_for("int4", free) == memory.need("int4").rows(free) >= 1


def test_bulk_generates_at_most_its_batch_and_what_fits(tmp_path, monkeypatch):
    """bulk's --batch left at its default (8 items a batch) generates as many at once as fit, at most
    8, where a --batch given must fit (a one-line error otherwise): an 8 GB card runs bulk's
    defaults with the rows it holds instead of refusing them."""
    from typer.testing import CliRunner

    from minicpm_cli.cli.app import app
    from minicpm_cli.cli.commands import bulk as command

    int4 = memory.need("int4")
    assert memory.rows_for("int4", int4.fixed + 2 * int4.per_row + 1, None, most=8) == 2
    assert memory.rows_for("compile", 80 * GB, None, most=8) == 8
    assert memory.rows_for("compile", None, None, most=8) == 8  # (a CPU)
    loads = []

    def load_here(*args, **kwargs):
        loads.append((args[6], kwargs["most_rows"]))
        raise OptionError("stop here")

    monkeypatch.setattr(command, "load_here", load_here)
    src = tmp_path / "items.txt"
    src.write_text("Hi.\nYo.\n")
    for extra, want in (([], (None, 8)), (["--batch", "3"], (3, 3))):
        r = CliRunner().invoke(app, ["bulk", str(src), "--out", str(tmp_path / "out"), "--device", "cpu", *extra])
        assert isinstance(r.exception, OptionError) and str(r.exception) == "stop here", r.output
        assert loads.pop() == want
