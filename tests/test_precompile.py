"""A first command's kernels compiled side by side while the model loads
(backends/kernels/precompile.py): which kernels each backend's mode asks for, when the helper starts,
and the helper itself, run as the loader runs it, compiling into a Triton cache of its own on the CPU
(for a capability named instead of a device's) and leaving a marker that makes the next run free.
Whether a GPU's first request then finds its kernels compiled is tests/test_gpu.py's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("triton")

from minicpm_cli.backends.kernels import launches, precompile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "tiny-minicpmo"


def test_groups_name_what_each_backend_runs():
    assert set(precompile.groups_for("compile", True)) == {"llm-invariant", "tts-invariant", "tts"}
    assert set(precompile.groups_for("compile", False)) == {"llm-variant", "tts-single", "tts"}
    assert set(precompile.groups_for("int4", True)) == {"llm-invariant", "int4-invariant", "tts-invariant", "tts"}
    assert set(precompile.groups_for("int4", False)) == {"int4-variant", "tts-single", "tts"}
    assert set(precompile.groups_for("gguf", True)) == {"tts-invariant", "tts"}
    assert precompile.groups_for("eager", True) == ()
    for backend in ("compile", "int4", "gguf"):
        for invariant in (True, False):
            assert set(precompile.groups_for(backend, invariant)) <= set(launches.GROUPS)


RECORD = """
import json, sys
from minicpm_cli.backends.kernels import launches
config = json.loads(open(sys.argv[1]).read())
keys = lambda *a: sorted(repr(x.key) for x in launches.record((9, 0), ("bfloat16",), *a)[0])
print(json.dumps({"tts": keys(("tts-invariant",), config), "both": keys(("tts-invariant", "tts"), config),
                  "full": keys(("tts-invariant",)), "where": sorted({x.where for x in launches.record(
                      (9, 0), ("bfloat16",), ("tts-invariant",), config)[0]})}))
"""


def test_recording_follows_the_groups_and_the_config():
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (the recording needs JIT functions)
    out = subprocess.run([sys.executable, "-c", RECORD, str(TINY / "config.json")], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["tts"] and set(got["tts"]) < set(got["both"])
    assert set(got["tts"]) != set(got["full"])  # (the sizes are constants of the kernels)
    assert got["where"] == ["TTS, batch-invariant (bfloat16)"]


@pytest.mark.parametrize("backend, device, env", [("eager", "cuda", {}), ("compile", "cpu", {}),
                                                  ("compile", "cuda", {"MINICPM_PRECOMPILE": "0"}),
                                                  ("compile", "cuda", {"TRITON_INTERPRET": "1"})])
def test_no_helper_where_it_cannot_help(monkeypatch, backend, device, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(precompile.os.path, "exists", lambda p: True)  # (as if a CUDA device node were there)
    monkeypatch.setattr(precompile.subprocess, "Popen", lambda *a, **k: pytest.fail("started"))
    assert precompile.start(backend, device, "auto", invariant=True, model=str(TINY)) is None


def _fake_gpu(monkeypatch, tmp_path):
    started = {}

    class Proc:
        pid = 4242

        def poll(self):
            return None

    def popen(cmd, **kw):
        started.update(cmd=cmd, **kw)
        return Proc()

    monkeypatch.delenv("MINICPM_PRECOMPILE", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(precompile.os.path, "exists", lambda p: True)
    monkeypatch.setattr(precompile, "gpu", lambda ordinal: ((8, 6), 46) if ordinal == 1 else None)
    monkeypatch.setattr(precompile.subprocess, "Popen", popen)
    monkeypatch.setattr(precompile.atexit, "register", lambda fn, proc: started.update(end=(fn, proc)))
    return started


def test_the_helper_starts_in_a_group_of_its_own_and_ends_with_us(monkeypatch, tmp_path):
    started = _fake_gpu(monkeypatch, tmp_path)
    helper = precompile.start("int4", "cuda:1", "auto", invariant=False, model=str(TINY))
    helper._thread.join(10)
    cmd = started["cmd"]
    assert cmd[1:3] == ["-m", "minicpm_cli.backends.kernels.precompile"]
    assert cmd[cmd.index("--cc") + 1] == "8.6" and cmd[cmd.index("--sms") + 1] == "46"
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and cmd[cmd.index("--model") + 1] == str(TINY)
    assert cmd[cmd.index("--groups") + 1] == "int4-variant,tts-single,tts"
    assert started["start_new_session"] and started["stdout"] == subprocess.DEVNULL
    assert started["end"] == (precompile._end, helper.proc) and helper.running()
    killed = []
    monkeypatch.setattr(precompile.os, "killpg", lambda pid, sig: killed.append((pid, sig)))
    precompile._end(helper.proc)
    assert killed == [(4242, precompile.signal.SIGTERM)]


def test_no_helper_process_once_the_marker_is_there(monkeypatch, tmp_path):
    started = _fake_gpu(monkeypatch, tmp_path)
    groups = precompile.groups_for("compile", True)
    done = precompile.marker((8, 6), 46, "bfloat16", groups, (TINY / "config.json").read_bytes())
    done.parent.mkdir(parents=True)
    done.write_text("")
    helper = precompile.start("compile", "cuda:1", "bfloat16", invariant=True, model=str(TINY))
    helper.wait(10)
    assert helper.proc is None and not started and not helper.running()
    other = precompile.start("compile", "cuda:0", "bfloat16", invariant=True, model=str(TINY))  # (no such GPU)
    other.wait(10)
    assert other.proc is None and not started


def _helper(cache: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (JIT functions, not the interpreter's)
    env["TRITON_CACHE_DIR"] = str(cache)
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "minicpm_cli.backends.kernels.precompile", "--verbose", "--jobs", "2",
                          *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    return out, time.perf_counter() - t


def test_the_helper_fills_the_cache_once(tmp_path):
    args = ("--cc", "8.6", "--groups", "tts-invariant", "--model", str(TINY))
    out, _ = _helper(tmp_path, *args)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "'failed': 0" in out.stderr and "'skipped': False" in out.stderr
    compiled = {p.name for p in tmp_path.iterdir() if p.name != "minicpm-precompiled"}
    markers = list((tmp_path / "minicpm-precompiled").iterdir())
    assert len(markers) == 1 and len(compiled) >= 4  # (Triton's cache: a folder a kernel)
    again, _ = _helper(tmp_path, *args)
    assert again.returncode == 0 and "'skipped': True" in again.stderr
    assert {p.name for p in tmp_path.iterdir() if p.name != "minicpm-precompiled"} == compiled
    other, _ = _helper(tmp_path, "--cc", "8.6", "--groups", "tts-invariant", "--model", str(TINY), "--dtype", "float32")
    assert other.returncode == 0 and "'skipped': False" in other.stderr  # (another set: another marker)
    assert len(list((tmp_path / "minicpm-precompiled").iterdir())) == 2


def test_a_model_not_downloaded_yet_has_the_official_sizes(tmp_path, monkeypatch):
    import huggingface_hub

    asked = []
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: asked.append(repo))  # (none)
    assert precompile._config("openbmb/MiniCPM-o-2_6") == (None, None) and asked == ["openbmb/MiniCPM-o-2_6"]
    config, raw = precompile._config(str(TINY))
    assert raw == (TINY / "config.json").read_bytes() and config["tts_config"]
    for missing in (str(tmp_path / "nowhere"), "./nowhere", "nowhere"):
        with pytest.raises(LookupError):
            precompile._config(missing)


def test_the_helper_gives_up_quietly_without_a_config(tmp_path):
    out, _ = _helper(tmp_path, "--cc", "8.6", "--groups", "tts", "--model", str(tmp_path / "nowhere"))
    assert out.returncode == 1 and not list(tmp_path.iterdir())


@pytest.mark.gpu
def test_a_first_request_finds_its_kernels_compiled(tmp_path):
    """The helper's recording is what the launch sites ask on this GPU: after it, a `say` on the tiny
    checkpoint (compile, batch-invariant, bfloat16) compiles no Triton kernel of its own."""
    import json

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cache = tmp_path / "triton"
    cc = "%d.%d" % torch.cuda.get_device_capability()
    groups = ",".join(precompile.groups_for("compile", True))
    out, _ = _helper(cache, "--cc", cc, "--groups", groups, "--model", str(TINY), "--jobs", "8")
    assert out.returncode == 0, out.stderr[-2000:]
    before = {p.name for p in cache.iterdir()}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache), MINICPM_PRECOMPILE="0")
    said = subprocess.run([sys.executable, "-m", "minicpm_cli", "say", "Hello world, how are you today?", "-o",
                           str(tmp_path / "out.wav"), "--local", "--model", str(TINY), "--backend", "compile",
                           "--device", "cuda", "--dtype", "bfloat16"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert said.returncode == 0, said.stderr[-2000:]
    missed = []
    for d in sorted({p.name for p in cache.iterdir()} - before):
        meta = [json.loads(f.read_text()) for f in (cache / d).glob("*.json") if not f.name.startswith("__grp__")]
        missed += [m.get("name", d) for m in meta]
    assert not missed, f"compiled by the request, not the helper: {missed}"
