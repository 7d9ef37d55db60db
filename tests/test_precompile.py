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
keys = lambda *a, **k: sorted(repr(x.key) for x in launches.record((9, 0), ("bfloat16",), *a, **k)[0])
calls = []
final = launches.record((9, 0), ("bfloat16",), ("llm-invariant", "tts-invariant", "tts"), config,
                       found=calls.append)[0]
print(json.dumps({"later": sorted({x.name for x in final if x.later}), "tts_later": [x.name for x in final if x.later
                  and x.where.startswith("TTS")], "found": [[repr(x.key), x.later] for x in calls],
                  "final": {repr(x.key): x.later for x in final},
                  "tts": keys(("tts-invariant",), config), "both": keys(("tts-invariant", "tts"), config),
                  "steps": keys(("tts",), config), "one_row": keys(("tts",), config, rows=(1,)),
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
    assert got["one_row"] and set(got["one_row"]) < set(got["steps"])  # (a one-stream command's fewer)
    # the LLM's decoding is recorded `later` (a helper compiles it after the rest), nothing of the
    # TTS's (its prompts come in chunks of a few tokens: a short read's products at under 16 tokens)
    assert "rows_attend_dot" in got["later"] and got["tts_later"] == []
    seen = {}
    for key, later in got["found"]:  # (a launch is found again only where it was `later` and is wanted sooner)
        assert key not in seen or (seen[key] and not later)
        seen[key] = later
    assert seen == got["final"] and any(later for later in seen.values())


def test_a_helper_compiles_what_a_short_request_runs_first():
    from minicpm_cli.backends.kernels.launches import Launch

    def launch(name, later):
        return Launch("m", name, (), (), (), (), "here", jit_key=name, later=later, qualname=name)

    submitted, noted = [], []
    order = precompile.Order(lambda ident, x: submitted.append(x.name), noted.append)
    for name, later in [("decode", True), ("prompt", False), ("long", True), ("decode", False), ("step", False)]:
        order.found(launch(name, later))
    assert submitted == ["prompt", "decode", "step"]  # ("decode": wanted sooner once found for a short request)
    order.flush()
    assert submitted == ["prompt", "decode", "step", "long"]
    assert [x.split()[2] for x in noted] == ["decode", "prompt", "long", "step"]  # (each planned once)


@pytest.mark.parametrize("backend, device, env, cpus", [
    ("compile", "cuda", {}, 16),  # (the control: this one starts)
    ("eager", "cuda", {}, 16), ("compile", "cpu", {}, 16), ("compile", "cuda", {"MINICPM_PRECOMPILE": "0"}, 16),
    ("compile", "cuda", {"TRITON_INTERPRET": "1"}, 16), ("compile", "cuda", {}, precompile.MIN_CPUS - 1)])
def test_no_helper_where_it_cannot_help(monkeypatch, backend, device, env, cpus):
    monkeypatch.delenv("MINICPM_PRECOMPILE", raising=False)  # (the suite's own setting)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(precompile.warmstart, "gpu_node", lambda: True)  # (as if a CUDA device node were there)
    monkeypatch.setattr(precompile, "cpus", lambda: cpus)
    monkeypatch.setattr(precompile, "Helper", lambda *args: ("helper", args))
    got = precompile.start(backend, device, "auto", invariant=True, model=str(TINY))
    control = (backend, device, env, cpus) == ("compile", "cuda", {}, 16)
    assert got == (("helper", (0, "bfloat16", precompile.groups_for("compile", True), str(TINY), False))
                   if control else None)


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
    monkeypatch.setattr(precompile.warmstart, "gpu_node", lambda: True)
    monkeypatch.setattr(precompile, "cpus", lambda: 16)
    monkeypatch.setattr(precompile, "gpu", lambda ordinal: ((8, 6), 46) if ordinal == 1 else None)
    monkeypatch.setattr(precompile.subprocess, "Popen", popen)
    monkeypatch.setattr(precompile, "_on_exit", lambda fn, proc: started.update(end=(fn, proc)))
    return started


def test_the_helper_starts_in_a_group_of_its_own_and_ends_with_us_unless_released(monkeypatch, tmp_path):
    started = _fake_gpu(monkeypatch, tmp_path)
    helper = precompile.start("int4", "cuda:1", "auto", invariant=False, model=str(TINY))
    helper._thread.join(10)
    cmd = started["cmd"]
    assert cmd[1:3] == ["-m", "minicpm_cli.backends.kernels.precompile"]
    assert cmd[cmd.index("--cc") + 1] == "8.6" and cmd[cmd.index("--sms") + 1] == "46"
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and cmd[cmd.index("--model") + 1] == str(TINY.resolve())
    assert cmd[cmd.index("--groups") + 1] == "int4-variant,tts-single,tts"
    assert cmd[cmd.index("--parent") + 1] == str(os.getpid())
    groups = precompile.groups_for("int4", False)  # (the loading process names the marker: one computation)
    assert cmd[cmd.index("--marker") + 1] == str(precompile.marker((8, 6), 46, "bfloat16", groups,
                                                                   (TINY / "config.json").read_bytes()))
    assert started["cwd"] == str(precompile._package().parent)  # (where minicpm_cli is: not the user's directory)
    assert started["start_new_session"] and started["stdout"] == subprocess.DEVNULL
    fd = int(cmd[cmd.index("--release-fd") + 1])
    assert started["pass_fds"] == (fd,) and started["end"] == (precompile._end, helper) and helper.running()
    killed = []
    monkeypatch.setattr(precompile.os, "killpg", lambda pid, sig: killed.append((pid, sig)))
    precompile._end(helper)  # (at our exit, unreleased: the helper's whole group ends)
    assert killed == [(4242, precompile.signal.SIGTERM)]
    precompile.release()  # (a command that succeeded: a byte on the pipe, which has no reader here)
    precompile._end(helper)
    assert killed == [(4242, precompile.signal.SIGTERM)] and helper._release_fd is None


def test_no_helper_process_once_the_marker_is_there(monkeypatch, tmp_path):
    started = _fake_gpu(monkeypatch, tmp_path)
    groups = precompile.groups_for("compile", True)
    done = precompile.marker((8, 6), 46, "bfloat16", groups, (TINY / "config.json").read_bytes())
    done.parent.mkdir(parents=True)
    done.write_text("")
    helper = precompile.start("compile", "cuda:1", "bfloat16", invariant=True, model=str(TINY))
    helper.wait(10)
    assert helper.proc is None and not started and not helper.running()
    other = precompile.start("compile", "cuda:1", "bfloat16", invariant=False, model=str(TINY))  # (another set)
    other._thread.join(10)
    assert started["cmd"]


def test_each_compilation_waits_for_its_kernel_while_the_helper_runs(monkeypatch):
    from triton import knobs

    calls = []

    class FakeHelper:
        done = False

        def running(self):
            return not self.done

        def finished(self):
            return self.done

        def wait(self, timeout, ident=None):
            calls.append(("wait", ident))

    class Fn:
        module, name = "minicpm_cli.backends.kernels.norm", "_rms_norm"

    def previous(**kwargs):
        calls.append(("previous", kwargs["key"]))
        return False

    helper = FakeHelper()
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", previous)
    precompile.wait_before_compiling(helper, timeout=7)
    hook = knobs.runtime.jit_cache_hook
    assert hook is not previous
    assert hook(key="k1", fn=Fn()) is False and knobs.runtime.jit_cache_hook is hook  # (kept while it runs)
    helper.done = True
    assert hook(key="k2", fn=Fn()) is False
    assert knobs.runtime.jit_cache_hook is previous  # (the hook set before is back)
    ident = precompile.launch_id(Fn.module, Fn.name, repr("k1"))
    assert calls == [("wait", ident), ("previous", "k1"), ("previous", "k2")]


def test_a_hook_that_names_no_kernel_waits_for_the_whole_helper_once(monkeypatch):
    from triton import knobs

    calls = []

    class FakeHelper:
        def running(self):
            return True

        def finished(self):
            return False

        def wait(self, timeout, ident=None):
            calls.append(ident)

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    precompile.wait_before_compiling(FakeHelper(), timeout=7)
    assert knobs.runtime.jit_cache_hook(repr="k") is False
    assert knobs.runtime.jit_cache_hook is None and calls == [None]


def test_progress_is_read_as_it_grows(tmp_path):
    path = tmp_path / "m.progress"
    progress = precompile.Progress(path)
    progress.read()  # (no file yet)
    path.write_text("P a\nP b\nD a\nP c")  # (the last line still being written)
    progress.read()
    assert progress.planned == {"a", "b"} and progress.done == {"a"} and not progress.recorded
    with open(path, "a") as f:
        f.write("\nR\nD c\n")
    progress.read()
    assert progress.planned == {"a", "b", "c"} and progress.done == {"a", "c"} and progress.recorded
    path.unlink()  # (a helper after one that was stopped writes a new file: read from its start)
    path.write_text("P d name\nF d\n")
    progress.read()
    assert "d" in progress.planned and "d" in progress.done and not progress.recorded  # (F: failed, not waited for)


def test_waiting_for_a_kernel_ends_when_it_is_compiled_or_not_planned(tmp_path, monkeypatch):
    import threading

    started = _fake_gpu(monkeypatch, tmp_path)
    helper = precompile.start("compile", "cuda:1", "bfloat16", invariant=True, model=str(TINY))
    helper._thread.join(10)
    assert started["cmd"] and helper.running()
    path = precompile._progress_path(helper.marker)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("P a\nP b\n")

    def later(line):
        time.sleep(0.3)
        with open(path, "a") as f:
            f.write(line)

    for ident, line in (("a", "D a\n"), ("x", "R\n")):  # (compiled; not the helper's once recorded)
        t = time.monotonic()
        threading.Thread(target=later, args=(line,)).start()
        helper.wait(10, ident)
        assert 0.25 < time.monotonic() - t < 5
    t = time.monotonic()
    helper.wait(0.3, "b")  # (planned, not compiled: up to the timeout)
    assert time.monotonic() - t >= 0.3
    helper.marker.write_text("")  # (done: nothing more to wait for)
    assert helper.finished()
    t = time.monotonic()
    helper.wait(10, "b")
    assert time.monotonic() - t < 1


def test_a_model_names_its_sizes(tmp_path):
    assert precompile._config(None) == (None, None)
    assert precompile._config("openbmb/MiniCPM-o-2_6") == (None, None)  # (a hub id: the official sizes)
    config, raw = precompile._config(str(TINY))
    assert raw == (TINY / "config.json").read_bytes() and config["tts_config"]
    (tmp_path / "empty").mkdir()
    for missing in (str(tmp_path / "nowhere"), str(tmp_path / "empty"), "./nowhere", "nowhere"):
        with pytest.raises(LookupError):
            precompile._config(missing)


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
    markers = [p for p in (tmp_path / "minicpm-precompiled").iterdir() if not p.suffix]
    assert len(markers) == 1 and len(compiled) >= 4  # (Triton's cache: a folder a kernel)
    again, _ = _helper(tmp_path, *args)
    assert again.returncode == 0 and "'skipped': True" in again.stderr
    assert {p.name for p in tmp_path.iterdir() if p.name != "minicpm-precompiled"} == compiled
    other, _ = _helper(tmp_path, "--cc", "8.6", "--groups", "tts-invariant", "--model", str(TINY), "--dtype", "float32")
    assert other.returncode == 0 and "'skipped': False" in other.stderr  # (another set: another marker)
    assert len([p for p in (tmp_path / "minicpm-precompiled").iterdir() if not p.suffix]) == 2


def test_the_helper_writes_the_marker_it_is_given(tmp_path):
    given = tmp_path / "minicpm-precompiled" / "given"
    out, _ = _helper(tmp_path, "--cc", "8.6", "--groups", "llm-variant", "--model", str(TINY), "--marker", str(given))
    assert out.returncode == 0, out.stderr[-2000:]
    assert given.is_file() and "0 failed, 0 lost" in given.read_text()
    assert sorted(p.name for p in given.parent.iterdir()) == ["given", "given.lock", "given.progress"]
    lines = (given.parent / "given.progress").read_text().splitlines()
    planned = {x.split()[1] for x in lines if x.startswith("P ")}  # ("P id name")
    assert planned and planned == {x[2:] for x in lines if x.startswith("D ")} and "R" in lines


def _running_in_group(pgid: int) -> bool:
    """Whether a process of group `pgid` (the helper and its workers) is alive (an exited one left
    unreaped, a zombie, is not: a container's first process may never reap it)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # (after the command's name: state, ppid, pgrp)
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


PARENT = """
import os, subprocess, sys, time
from pathlib import Path
r, w = os.pipe()
p = subprocess.Popen(sys.argv[2:] + ["--parent", str(os.getpid()), "--release-fd", str(r)], pass_fds=(r,),
                     start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(p.pid, flush=True)
if sys.argv[1]:  # (a progress file to wait for, then a release: the helper at work, let finish)
    deadline = time.monotonic() + 120
    while not Path(sys.argv[1]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.write(w, b"1")
os._exit(0)  # (as an interrupt leaves: no atexit functions)
"""


def _orphan(tmp_path, args, release: Path | None, wait: float) -> bool:
    """Start a helper (`args`) from a parent Python that releases it once `release` (a progress file)
    exists, or not at all (None), and leaves at once -> whether the helper's whole group ended within
    `wait` s (else it is killed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    helper = [sys.executable, "-m", "minicpm_cli.backends.kernels.precompile", "--cc", "8.6", "--jobs", "2",
              "--model", str(TINY), *args]
    out = subprocess.run([sys.executable, "-c", PARENT, str(release or ""), *helper], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=180)
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + wait
    while _running_in_group(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _running_in_group(pid):
        os.killpg(pid, 9)
        return False
    return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_the_helper_ends_when_its_parent_has_gone(tmp_path):
    """A command that ends without releasing its helper (an interrupt leaves through os._exit, without
    atexit functions) leaves none behind: the helper watches its parent and ends its whole group."""
    assert _orphan(tmp_path, ["--groups", "tts-invariant,tts"], None, 30), "the helper outlived its parent"
    assert not (tmp_path / "minicpm-precompiled").exists() or not any(
        not p.suffix for p in (tmp_path / "minicpm-precompiled").iterdir())  # (stopped before done)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_released_helper_finishes_after_its_parent(tmp_path):
    """A command that succeeds releases its helper: it finishes and writes its marker, so the next
    command starts none."""
    done = tmp_path / "minicpm-precompiled" / "given"
    args = ["--groups", "tts", "--rows", "1", "--marker", str(done)]
    assert _orphan(tmp_path, args, precompile._progress_path(done), 300), "the released helper did not finish"
    assert "0 failed, 0 lost" in done.read_text()


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


@pytest.mark.parametrize("code, released", [(None, True), (0, True), (1, False), (2, False), (130, False)])
def test_only_a_command_that_succeeded_releases_its_helpers(monkeypatch, code, released):
    """An error, an interrupt or a kill (SystemExit from the CLI's boundary) ends the helpers with the
    command; success lets them finish (entry.main -> precompile.release)."""
    from minicpm_cli.cli import app, entry

    calls = []
    monkeypatch.setattr(precompile, "release", lambda: calls.append("release"))

    def run():
        if code is not None:
            raise SystemExit(code)

    monkeypatch.setattr(app, "main", run)
    monkeypatch.setattr(entry, "_exit", lambda status: calls.append(("exit", status)))
    monkeypatch.setattr(entry.signal, "signal", lambda *a: None)  # (the suite keeps its own SIGINT handler)
    monkeypatch.setattr(entry.sys, "exit", lambda status: calls.append(("exit", status)))
    entry.main()
    assert ("release" in calls) == released and calls[-1] == ("exit", code)


def test_a_release_is_a_byte_left_on_the_pipe():
    pipes = [os.pipe() for _ in range(3)]
    os.write(pipes[0][1], b"1")  # (released, then the parent ended: the byte is still there)
    os.close(pipes[0][1])
    os.close(pipes[1][1])  # (ended without a release)
    try:  # (the third: still held open, nothing written)
        assert [precompile._released(r) for r, _ in pipes] == [True, False, False]
        assert precompile._released(None) is False
    finally:
        for r, _ in pipes:
            os.close(r)
        os.close(pipes[2][1])
