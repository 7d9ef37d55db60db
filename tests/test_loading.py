"""Loading reads each tensor once, straight onto its device (minicpm_cli/tensorio.py): the tensors
it gives equal safetensors' own reader bit for bit, whatever the chunking, on the CPU and the GPU."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from minicpm_cli.engine.checkpoint import Checkpoint
from minicpm_cli.errors import CheckpointError
from minicpm_cli.engine.synthetic import SyntheticSpec, write_checkpoint
from minicpm_cli.engine.tensorio import _chunks, read_header

from conftest import pythonpath


def _oracle(root) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, tiny_dir):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "sharded", SyntheticSpec.tiny(), tokenizer_from=tiny_dir,
                            max_shard_bytes=1 << 20, include_vision_audio=True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                       b.contiguous().view(-1).view(torch.uint8))


@pytest.mark.parametrize("which", ["tiny", "sharded"])
def test_prefetch_equals_safetensors_on_the_cpu(which, tiny_dir, sharded):
    root = tiny_dir if which == "tiny" else sharded
    ref = _oracle(root)
    ckpt = Checkpoint(root)
    ckpt.prefetch(list(ref), "cpu")
    for k, v in ref.items():
        assert _same(ckpt.tensor(k), v), k
    assert not ckpt._read  # handed out, not kept


def test_tensor_converts_like_torch(tiny_dir):
    ckpt = Checkpoint(tiny_dir)
    key = "llm.model.layers.0.self_attn.q_proj.weight"
    want = load_file(tiny_dir / "model.safetensors")[key].to(torch.float32)
    assert torch.equal(ckpt.tensor(key, torch.float32), want)


@pytest.mark.parametrize("limit", [7, 1000, 1 << 16])
def test_chunks_cover_every_byte_once(tiny_dir, limit):
    entries = read_header(tiny_dir / "model.safetensors")
    seen = {k: [] for k, e in entries.items() if e.end > e.begin}
    for c in _chunks(entries, limit):
        assert 0 < c.length <= limit
        at = 0
        for name, off, src, n in c.pieces:
            assert src == at and n > 0  # pieces fill the read back to back
            assert entries[name].begin + off == c.offset + src  # the bytes they name are the file's
            seen[name].append((off, n))
            at += n
        assert at == c.length
    for name, parts in seen.items():
        e = entries[name]
        covered = 0
        for off, n in sorted(parts):
            assert off == covered
            covered += n
        assert covered == e.end - e.begin, name


def test_truncated_file_is_a_checkpoint_error(tiny_dir, tmp_path):
    data = (tiny_dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        Checkpoint(tmp_path).tensor("llm.model.norm.weight")


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["tiny", "sharded"])
def test_prefetch_equals_safetensors_on_the_gpu(which, tiny_dir, sharded, monkeypatch):
    import minicpm_cli.engine.tensorio as tio

    monkeypatch.setattr(tio, "CHUNK", 4096)  # many chunks: tensors split across reads and buffers
    root = tiny_dir if which == "tiny" else sharded
    ref = _oracle(root)
    ckpt = Checkpoint(root)
    ckpt.prefetch(list(ref), "cuda")
    for k, v in ref.items():
        t = ckpt.tensor(k)
        assert t.device.type == "cuda" and _same(t.cpu(), v), k


@pytest.mark.parametrize("backend,gguf,device,node,started", [
    ("compile", None, "auto", True, ["minicpm-cuda", "minicpm-triton-key"]),
    ("int4", None, "cuda:1", True, ["minicpm-cuda", "minicpm-triton-key"]),
    ("auto", None, "cuda", True, ["minicpm-cuda", "minicpm-triton-key"]),
    ("auto", "x.gguf", "cuda", True, ["minicpm-cuda"]), ("eager", None, "cuda", True, ["minicpm-cuda"]),
    ("compile", None, "cpu", True, []), ("compile", None, "cpu:0", True, []), ("compile", None, "mps", True, []),
    ("compile", None, "auto", False, [])])
def test_the_warm_start_runs_only_for_a_gpu(backend, gguf, device, node, started, monkeypatch):
    """engine/warmstart.py, as `loading.load` starts it: the CUDA context for a GPU (of the ordinal
    named), Triton's key for a backend that runs Triton kernels or may (auto without a GGUF file);
    nothing once torch is imported."""
    pytest.importorskip("triton")
    import sys

    from minicpm_cli.engine import loading, warmstart

    seen = []

    class Recorder:
        def __init__(self, target, args, daemon, name):
            seen.append((name, args))

        def start(self):
            pass

    class Stop(Exception):
        pass

    def pick(*a):
        raise Stop

    monkeypatch.setattr(warmstart.threading, "Thread", Recorder)
    exists = os.path.exists
    monkeypatch.setattr(warmstart.os.path, "exists", lambda p: node if p == "/dev/nvidiactl" else exists(p))
    monkeypatch.setattr(loading, "pick", pick)
    torch_module = sys.modules["torch"]
    monkeypatch.delitem(sys.modules, "torch")
    with pytest.raises(Stop):
        loading.load(None, backend, device, "auto", gguf)
    assert [name for name, _ in seen] == started
    if started:
        assert seen[0][1][1] == (1 if device == "cuda:1" else 0)
    seen.clear()
    monkeypatch.setitem(sys.modules, "torch", torch_module)
    warmstart.begin(True, "cuda")
    assert seen == []


def test_the_triton_key_thread_imports_nothing():
    """What the key's thread runs imports no module (Triton and the packages it walks are imported
    before the thread starts), so it cannot meet torch's import in a module lock; a second call is
    Triton's cached value."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    code = ("import sys\n"
            "from minicpm_cli.engine import warmstart\n"
            "key = warmstart._import_triton()\n"
            "before = set(sys.modules)\n"
            "k = key()\n"
            "print(sorted(set(sys.modules) - before), 'torch' in sys.modules, key() is k)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": pythonpath()})
    assert out.stdout.strip() == "[] False True", (out.stdout, out.stderr)


def test_gguf_names_a_local_file_or_a_hub_repository(tmp_path, monkeypatch):
    """--gguf: a file here whatever its name (a GGUF by its magic), else a path not found, else REPO[:FILE];
    a name the hub cannot take is a one-line error, not huggingface_hub's ValueError."""
    from minicpm_cli.backends.gguf import resolve_gguf
    from minicpm_cli.errors import ModelNotFound, UsageError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    good = tmp_path / "model.bin"
    good.write_bytes(b"GGUF" + bytes(12))
    assert resolve_gguf(str(good)) == good
    (tmp_path / "notes.gguf").write_text("hello")
    with pytest.raises(UsageError, match="not a GGUF file"):
        resolve_gguf(str(tmp_path / "notes.gguf"))
    with pytest.raises(UsageError, match="is a directory"):
        resolve_gguf(str(tmp_path))
    for missing in (str(tmp_path / "none.bin"), "./none.bin", "none.gguf", "~/none"):
        with pytest.raises(ModelNotFound, match="GGUF file not found"):
            resolve_gguf(missing)
    for bad in ("a/b:c:d", "bad repo!"):
        with pytest.raises(ModelNotFound, match="not a model repository id"):
            resolve_gguf(bad)
    with pytest.raises(ModelNotFound, match="HF_HUB_OFFLINE"):
        resolve_gguf("someone/some-model:x.gguf")
