"""Shared fixtures: the tiny checkpoint in the official layout and the reference goldens."""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (read when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# `say` and `reply` use a server running at the default address: a developer's own `minicpm serve`
# must not answer the tests (the server tests name theirs explicitly).
os.environ["MINICPM_SERVER"] = ""
# A first load's kernels compiled side by side (backends/kernels/precompile.py): not under the tests'
# own loads (a helper process a load, racing the tests' timings); tests/test_precompile.py tests it.
os.environ["MINICPM_PRECOMPILE"] = "0"
# Saved voices (`minicpm voice`, a server's voices): never the developer's own; tests that save voices
# give their commands and servers a directory of their own.
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="minicpm-tests-data-")
atexit.register(shutil.rmtree, os.environ["XDG_DATA_HOME"], ignore_errors=True)

FIXTURES = Path(__file__).parent / "fixtures"
TINY = FIXTURES / "tiny-minicpmo"
# tiny-minicpmo-voice (the voice goldens' checkpoint) is tiny-minicpmo plus the audio encoder: only
# its extra tensors and its config.json are kept, and `voice_dir` puts the two together.
VOICE_EXTRA = FIXTURES / "tiny-minicpmo-voice-extra"
TOOLS = Path(__file__).resolve().parents[1] / "tools"


def pythonpath() -> str:
    """A child process's PYTHONPATH: the checkout first, then what ours already holds (the GPU
    machine's carried packages are only on PYTHONPATH; a child without them lost soundfile)."""
    return os.pathsep.join(p for p in (str(TOOLS.parent), os.environ.get("PYTHONPATH")) if p)


def _tool(name: str):
    """A script of tools/ as a module (tools/ is not a package, and is kept off sys.path)."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def goldens():
    return np.load(FIXTURES / "goldens.npz")


@pytest.fixture(scope="session")
def manifest():
    return json.loads((FIXTURES / "manifest.json").read_text())


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return TINY


@pytest.fixture(scope="session")
def codec():
    """The tiny checkpoint's DVAE decoder (bf16 in the file, upcast) and Vocos, float32 on the CPU."""
    from safetensors import safe_open

    from minicpm_cli.engine.codec import Codec

    prefix = "tts.dvae."
    with safe_open(TINY / "model.safetensors", framework="pt") as f:
        dvae = {k[len(prefix):]: f.get_tensor(k).float() for k in f.keys() if k.startswith(prefix)}
    vocos = torch.load(TINY / "assets" / "Vocos.pt", map_location="cpu", weights_only=True)
    return Codec.from_tensors(dvae, vocos, "cpu")


@pytest.fixture(scope="session")
def goldens_voice():
    return np.load(FIXTURES / "goldens_voice.npz")


@pytest.fixture(scope="session")
def manifest_voice():
    return json.loads((FIXTURES / "manifest_voice.json").read_text())


@pytest.fixture(scope="session")
def voice_dir(tmp_path_factory) -> Path:
    """tiny-minicpmo-voice assembled in the official sharded layout, without copying weights: the base
    checkpoint's file and the audio encoder's file as two shards of one index, the voice config, and
    everything else linked from tiny-minicpmo (tools/tiny_voice_checkpoint.py, which newcomers run to
    try `--voice` on the tiny model)."""
    return _tool("tiny_voice_checkpoint").assemble(tmp_path_factory.mktemp("tiny-minicpmo-voice"), TINY, VOICE_EXTRA)


@pytest.fixture(scope="session")
def assert_read_golden(goldens, manifest):
    """assert_read_golden(synth, tag, atol): a greedy read of the manifest's text `tag` gives the
    reference's codes exactly and its waveform within `atol`."""
    from minicpm_cli.engine.sampling import Sampling

    def check(synth, tag: str, atol: float) -> None:
        text = next(e for e in manifest["read"] if e["tag"] == tag)["text"]
        utt = synth.say(text, Sampling(greedy=True))
        np.testing.assert_array_equal(utt.codes.numpy(), goldens[f"read_{tag}_codes"])
        np.testing.assert_allclose(utt.audio, goldens[f"read_{tag}_wav"], atol=atol, rtol=0)

    return check


def slow_writer(cmd: list[str], env: dict, pause: float = 0) -> tuple[int, bytes, bool, bytes]:
    """`cmd` (a `say` reading stdin) fed by a slow writer: the first sentence, then a wait until the
    first audio byte comes (or 120 s) and `pause` seconds more, then the rest and the end -> (exit
    status, stderr, whether audio came while the writer waited, stdout)."""
    import subprocess
    import threading
    import time

    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = threading.Event()
    out = bytearray()

    def read() -> None:
        while data := p.stdout.read1(1 << 16):
            out.extend(data)
            first.set()

    reader = threading.Thread(target=read)
    reader.start()
    p.stdin.write(b"The first sentence arrives alone.\n")
    p.stdin.flush()
    came = first.wait(120)
    time.sleep(pause)
    p.stdin.write(b"Then the rest of it.\n")
    p.stdin.close()
    p.wait(120)
    reader.join(10)
    return p.returncode, p.stderr.read(), came, bytes(out)


def tts_eager_and_kernel_runs(synth, text: str, device) -> list:
    """The eager TTS runner and the kernel-backed one (float32), each prefilled with `text`'s
    condition and a random speaker, then 4 greedy steps (the interpreter is slow) -> per runner
    (codes, the steps' raw logits)."""
    import torch

    from minicpm_cli.backends.compile import GraphTTSRunner
    from minicpm_cli.engine.tts import TTSRunner

    cond = synth.tokenizers.condition(text, synth.tts_model.config.streaming_text_reserved_len)
    spk = torch.nn.functional.normalize(torch.randn(synth.tts_model.config.decoder.dim), dim=0).to(device)
    runs = []
    for runner in (TTSRunner(synth.tts_model), GraphTTSRunner(synth.tts_model, use_triton=True)):
        runner.trace = []
        runner.start(cond.n)
        runner.prefill(cond.ids[: cond.n + 3], 0, spk)
        codes, _ = runner.generate(None, n_steps=4, min_new=4)
        runs.append((codes, torch.stack([raw for raw, _ in runner.trace])))
    return runs


def llm_eager_and_kernel_runs(tiny_dir, device, prompt: str, steps: int) -> list:
    """The eager LLM stage and the kernel-backed one (CompiledLLM with Triton, float32) on `tiny_dir`:
    `prompt` (a user message), then `steps` greedy tokens -> per stage (the logits of the prompt and
    each step, stacked; the last step's hidden state)."""
    import torch

    from minicpm_cli.backends.compile import CompiledLLM
    from minicpm_cli.engine.llm import user_turn
    from minicpm_cli.engine.pipeline import Synthesizer

    eager = Synthesizer.load(str(tiny_dir), backend="eager", device=device, dtype="float32")
    comp = Synthesizer.load(str(tiny_dir), backend="eager", device=device, dtype="float32")
    llm = CompiledLLM(comp.llm.model, max_len=512, use_triton=True)
    ids = eager.tokenizers.encode_llm(user_turn(prompt) + "<|im_start|>assistant\n")
    runs = []
    for stage in (eager.llm, llm):
        stage.reset()
        logits, _ = stage.forward(ids)
        out = [logits.clone()]  # a backend's buffers: valid until the next call
        for _ in range(steps):
            logits, hidden = stage.forward([int(logits.argmax())])
            out.append(logits.clone())
        runs.append((torch.stack(out), hidden.clone()))
    return runs
