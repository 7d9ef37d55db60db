"""The mistakes a new user makes, each answered by one line on stderr before any model is looked for
(`--model` names a directory that does not exist: an error about it would mean the check came too
late), with exit status 2 for an option's value and 1 for a place that cannot be written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import pythonpath
from test_cli import assert_one_line_error, run

NO_MODEL = ("--model", "/nonexistent/minicpm-model")
# A directory that exists and that nobody, root included, can create files in
UNWRITABLE = "/proc"


def assert_usage_error(p, *needles: str):
    err = p.stderr.decode()
    assert p.returncode == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("minicpm: error: "), err
    for n in needles:
        assert n in lines[0], err


def test_an_unwritable_output_is_refused_before_loading():
    assert_one_line_error(run("say", "Hi.", "-o", f"{UNWRITABLE}/x.wav", *NO_MODEL), "cannot write", UNWRITABLE)
    assert_one_line_error(run("reply", "Hi.", "-o", f"{UNWRITABLE}/x.wav", *NO_MODEL), "cannot write")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only directory")
def test_a_read_only_directory_is_refused_before_loading(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert_one_line_error(run("say", "Hi.", "-o", str(ro / "x.wav"), *NO_MODEL), "cannot write")
    finally:
        ro.chmod(0o755)


def test_an_output_naming_a_directory_is_refused_before_loading(tmp_path):
    assert_one_line_error(run("say", "Hi.", "-o", str(tmp_path), *NO_MODEL), "is a directory")


@pytest.mark.parametrize("name", ["out.wav", "out.flac", "OUT.WAV"])
def test_raw_pcm_under_an_audio_name_is_refused(tmp_path, name):
    p = run("say", "Hi.", "--raw", "-o", str(tmp_path / name), *NO_MODEL)
    assert_usage_error(p, "--raw")
    assert not (tmp_path / name).exists()


def test_say_dir_is_made_when_missing(tiny_dir, tmp_path):
    out = tmp_path / "new" / "lines"
    p = run("say", "--lines", "--dir", str(out), "--model", str(tiny_dir), "--greedy", "--device", "cpu",
            stdin=b"One line.\n")
    assert p.returncode == 0, p.stderr.decode()
    assert (out / "line-0001.wav").is_file()


def test_a_closed_or_full_output_is_one_line(tiny_dir, tmp_path):
    """stdout closed (`>&-`) is said before loading; a full disk (/dev/full) when the audio or the
    reply's text meets it: one line, exit 1, never a traceback."""
    env = {**os.environ, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1"}
    env.pop("MINICPM_DEBUG", None)
    tiny = ("--model", str(tiny_dir), "--device", "cpu", "--greedy")

    def minicpm(*args, **streams):
        p = subprocess.run([sys.executable, "-m", "minicpm_cli", *args], stdin=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, env=env, timeout=300, **streams)
        p.stdout = p.stdout or b""  # (not captured where it is closed or full)
        return p

    for args in (("say", "Hi.", "-o", "-"), ("say", "Hi."), ("reply", "Hi.", "--text-out", "-", "-o", "x.wav")):
        assert_one_line_error(minicpm(*args, *NO_MODEL, preexec_fn=lambda: os.close(1)), "standard output is closed")
    with open("/dev/full", "wb") as full:
        for args in (("say", "Hi.", "-o", "-"), ("say", "Hi.", "--raw", "-o", "-")):
            assert_one_line_error(minicpm(*args, *tiny, stdout=full), "cannot write the output: No space left")
    assert_one_line_error(run("reply", "Hi.", "--text-out", str(tmp_path), "-o", str(tmp_path / "x.wav"), *NO_MODEL),
                          "--text-out", "is a directory")
    p = minicpm("reply", "Hi.", "--text-out", "/dev/full", "--max-tokens", "4", "-o", str(tmp_path / "x.wav"), *tiny,
                stdout=subprocess.PIPE)
    assert_one_line_error(p, "cannot write the reply's text to /dev/full: No space left on device (it was: ")
    assert (tmp_path / "x.wav").is_file()  # (the audio is written all the same)


def test_files_written_whole_replace_a_links_target_and_write_a_device_in_place(tmp_path):
    """files.write_whole (bench --json, reply --text-out, captions, the manifest): a link stays a link
    to the new file, with a plain file's mode and no temporary left; a device (/dev/null, as
    /dev/stdout may be) is written, never replaced by a file."""
    from minicpm_cli.files import new_file_mode, write_whole

    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("old")
    link.symlink_to(real)
    write_whole(link, b"new")
    assert link.is_symlink() and real.read_bytes() == b"new"
    assert real.stat().st_mode & 0o777 == new_file_mode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]
    write_whole("/dev/null", b"into the device")
    assert Path("/dev/null").is_char_device()


def test_an_audio_file_named_by_a_link_is_written_where_it_points(tmp_path):
    """-o LINK: the link's target is the file written, as files.write_whole writes one; the link stays
    (the file was made beside the target and renamed onto the link: the link was replaced by a file,
    and where the target lay on another file system the rename failed with a traceback)."""
    import numpy as np
    import soundfile as sf

    from minicpm_cli.audio import open_sink

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name, kind in (("out.wav", False), ("out.flac", False), ("out.raw", True)):
        real, link = elsewhere / name, tmp_path / f"link-{name}"
        link.symlink_to(real)  # (dangling: the file is new)
        for _ in range(2):  # (then replacing the file the link names)
            sink = open_sink(str(link), "s16", 24000, raw=kind)
            sink.write(np.zeros(2400, dtype=np.float32))
            sink.close()
            assert link.is_symlink() and real.is_file(), name
            assert (real.stat().st_size if kind else sf.info(real).frames * 2) == 4800, name
    assert sorted(p.name for p in elsewhere.iterdir()) == ["out.flac", "out.raw", "out.wav"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "link-out.flac", "link-out.raw", "link-out.wav"]


def test_lines_from_a_file_that_cannot_be_read_is_refused_before_loading(tmp_path):
    """--lines -f FILE: a file that cannot be read is said before the model is looked for, as without
    --lines (it was opened at the first line, after the model had loaded and --dir had been made)."""
    out = tmp_path / "lines"
    for source in (tmp_path / "none.txt", tmp_path):
        assert_one_line_error(run("say", "--lines", "-f", str(source), "--dir", str(out), *NO_MODEL),
                              f"cannot read {source}")
        assert_one_line_error(run("say", "--lines", "-f", str(source), "-o", str(tmp_path / "x.wav"), *NO_MODEL),
                              f"cannot read {source}")
    assert list(tmp_path.iterdir()) == []


def test_an_output_that_is_the_voice_recording_is_refused_before_loading(tmp_path):
    """say/reply --voice REF.wav -o REF.wav (or through a link): the recording would be replaced by
    the speech, as it was; refused before any work, the recording kept."""
    ref = tmp_path / "me.wav"
    ref.write_bytes((Path(__file__).parent / "fixtures" / "voice_ref_a.wav").read_bytes())
    (tmp_path / "link.wav").symlink_to(ref)
    for command in ("say", "reply"):
        for out in (ref, tmp_path / "link.wav"):
            assert_usage_error(run(command, "Hi.", "--voice", str(ref), "-o", str(out), *NO_MODEL), "--voice recording")
    assert ref.read_bytes() == (Path(__file__).parent / "fixtures" / "voice_ref_a.wav").read_bytes()


def test_say_dir_unwritable_is_refused_before_loading():
    assert_one_line_error(run("say", "--lines", "--dir", UNWRITABLE, *NO_MODEL, stdin=b"x\n"), "cannot write")


def test_bulk_out_unwritable_is_refused_before_loading(tmp_path):
    items = tmp_path / "items.txt"
    items.write_text("One.\n")
    assert_one_line_error(run("bulk", str(items), "--out", UNWRITABLE, *NO_MODEL), "cannot write")


@pytest.mark.parametrize("blocked, args", [("soundfile", ("voice", "add", "me")), ("typer", ("--help",))])
def test_a_missing_package_is_one_line_naming_it(tmp_path, blocked, args):
    """A package we depend on gone from the user's Python (its import blocked in the child): one line
    naming it and the pip command, status 1, nothing written; typer's before the CLI's own boundary."""
    ref = Path(__file__).parent / "fixtures" / "voice_ref_a.wav"
    argv = ["minicpm", *args, *([str(ref)] if args[0] == "voice" else [])]
    code = (f"import sys; sys.modules[{blocked!r}] = None; sys.argv = {argv!r}\n"
            "from minicpm_cli.cli.entry import main; main()")
    env = {**os.environ, "PYTHONPATH": pythonpath(), "XDG_DATA_HOME": str(tmp_path / "data")}
    env.pop("MINICPM_DEBUG", None)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, timeout=300)
    assert_one_line_error(p, f"cannot import '{blocked}'", "pip install --force-reinstall minicpm-cli")
    assert not (tmp_path / "data" / "minicpm" / "voices" / "me.wav").exists()


def test_only_our_packages_gone_are_named_missing(monkeypatch):
    from minicpm_cli.cli import dependencies

    def gone(name):
        return ModuleNotFoundError(f"No module named '{name}'", name=name)

    assert dependencies.missing(gone("numpy")) is None  # (installed: something else went wrong)
    assert dependencies.missing(gone("soundfile._soundfile_data")) is None  # (inside an installed package)
    assert dependencies.missing(gone("minicpm_cli.nothing")) is None and dependencies.missing(gone("left_pad")) is None
    monkeypatch.setattr(dependencies.importlib.util, "find_spec", lambda name: None)  # (as if none were installed)
    assert dependencies.missing(gone("llama_cpp")).endswith(
        "the package llama-cpp-python, which minicpm-cli needs, is not installed in this Python "
        "(pip install 'minicpm-cli[gguf]')")
    assert dependencies.missing(gone("python_multipart")).endswith("(pip install --force-reinstall minicpm-cli)")


def test_the_missing_packages_table_names_every_dependency():
    tomllib = pytest.importorskip("tomllib")
    from minicpm_cli.cli.dependencies import PACKAGES

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    named = {dist: extra for dist, extra in PACKAGES.values()}

    def dist(requirement):
        return re.split(r"[\[<>=;! ]", requirement, maxsplit=1)[0].lower().replace("_", "-")

    assert {dist(r): None for r in project["dependencies"]} == {
        d.replace("_", "-"): e for d, e in named.items() if e is None}
    for extra in ("gguf", "ray"):
        assert {dist(r) for r in project["optional-dependencies"][extra]} == {
            d for d, e in named.items() if e == extra}


def test_voice_add_to_an_unwritable_voices_folder_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    ref = Path(__file__).parent / "fixtures" / "voice_ref_a.wav"
    p = run("voice", "add", "me", str(ref), env={"XDG_DATA_HOME": str(blocker)})
    assert_one_line_error(p, "cannot write in the voices folder")


@pytest.mark.parametrize("args, needle", [
    (("say", "Hi.", "--backend", "turbo"), "turbo"),
    (("say", "Hi.", "--pcm", "s24"), "s24"),
    (("say", "Hi.", "--device", "tpu"), "tpu"),
    (("say", "Hi.", "--dtype", "float16"), "float16"),
    (("reply", "Hi.", "--max-tokens", "0"), "--max-tokens"),
    (("say", "Hi.", "--batch", "0"), "--batch"),
    (("say", "Hi.", "--speed", "4.5"), "--speed must be between 0.25 and 4"),
    (("say", "Hi.", "--speed", "0.2"), "--speed"),
    (("say", "Hi.", "--speed", "nan"), "--speed"),
    (("reply", "Hi.", "--speed", "0"), "--speed"),
    (("serve", "--backend", "turbo"), "turbo"),
    (("serve", "--device", "tpu"), "tpu"),
    (("bench", "--workload", "sing"), "sing"),
    (("bench", "--dtype", "int3"), "int3"),
    (("reply", "Hi.", "--temperature", "nan"), "--temperature must be a positive number"),
    (("reply", "Hi.", "--temperature", "inf"), "--temperature"),
    (("reply", "Hi.", "--temperature", "0"), "--temperature"),
    (("reply", "Hi.", "--greedy", "--temperature", "0.5"), "--greedy takes no --temperature"),
    (("say", "Hi.", "--seed", str(2**64)), "--seed must be between"),
    (("reply", "Hi.", "--seed", str(-2**63 - 1)), "--seed must be between"),
    (("say", "Hi.", "--server", "http://127.0.0.1:99999"), "its port is not a number from 0 to 65535"),
    (("reply", "Hi.", "--server", "localhost:port"), "not an http:// URL: localhost:port"),
])
def test_every_invalid_option_value_exits_2(tmp_path, args, needle):
    p = run(*args, "-o" if args[0] in ("say", "reply") else "--model", *(
        (str(tmp_path / "x.wav"), *NO_MODEL) if args[0] in ("say", "reply") else (NO_MODEL[1],)))
    assert_usage_error(p, needle)


def test_an_output_of_an_unknown_format_exits_2(tmp_path):
    for name in ("x.mp3", "x.ogg", "x", "x.raw", "x.pcm"):
        assert_usage_error(run("say", "Hi.", "-o", str(tmp_path / name), *NO_MODEL), "cannot tell the audio format",
                           "--raw for headerless PCM")  # (a .raw or .pcm name was told of WAV and FLAC alone)
    assert list(tmp_path.iterdir()) == []


def test_reply_text_and_audio_both_on_stdout_exits_2():
    assert_usage_error(run("reply", "Hi.", "--text-out", "-", "-o", "-", *NO_MODEL), "--text-out -")


def test_bulk_input_that_is_not_a_file_is_one_line(tmp_path):
    out = str(tmp_path / "o")
    assert_one_line_error(run("bulk", str(tmp_path), "--out", out, *NO_MODEL), "is a directory")
    assert_one_line_error(run("bulk", "-", "--out", out, *NO_MODEL, stdin=b"One.\n"), "reads a file")
    assert_one_line_error(run("bulk", str(tmp_path / "none.txt"), "--out", out, *NO_MODEL), "no such file")


def test_bench_refuses_what_it_cannot_honour_before_it_loads_anything(tmp_path):
    """Each of these was refused (or lost) only after the model loaded and the runs ran: now before."""
    assert_usage_error(run("bench", "--max-tokens", "0", *NO_MODEL), "--max-tokens must be at least 1")
    assert_one_line_error(run("bench", "--json", str(tmp_path), *NO_MODEL), "is a directory")
    assert_one_line_error(run("bench", "--json", str(tmp_path / "no" / "x.json"), *NO_MODEL),
                          "output directory does not exist")
    assert_one_line_error(run("bench", "--json", f"{UNWRITABLE}/x.json", *NO_MODEL), f"cannot write in {UNWRITABLE}")
    assert_usage_error(run("bench", "--json", "-", *NO_MODEL), "--json writes a file")
    for flags in (("--runs", "0"), ("--workload", "reply"), ("--max-tokens", "9"), ("--first-chunk", "5")):
        assert_usage_error(run("bench", "--startup", "--model", str(tmp_path), *flags), flags[0], "cannot apply")
    assert_usage_error(run("bench", "--voice", "default", *NO_MODEL), "the model's own voice")
    assert_one_line_error(run("bench", "--voice", "nobody", *NO_MODEL, env={"XDG_DATA_HOME": str(tmp_path)}),
                          "nobody")
    assert list(tmp_path.iterdir()) == []


def test_bulk_invalid_values_exit_2(tmp_path):
    items = tmp_path / "items.txt"
    items.write_text("One.\n")
    assert_usage_error(run("bulk", str(items), "--out", str(tmp_path / "o"), "--device", "tpu", *NO_MODEL), "tpu")
    assert_usage_error(run("bulk", str(items), "--out", str(tmp_path / "o"), "--backend", "turbo", *NO_MODEL), "turbo")
    assert_usage_error(run("bulk", str(items), "--out", str(tmp_path / "o"), "--speed", "5", *NO_MODEL), "--speed")


def test_an_unreachable_hub_is_said_at_once_and_fails_within_seconds(tmp_path):
    """No network: one line says the model is being fetched, and the error follows within seconds
    (the hub's client alone retried for tens of seconds). The hub is a closed port on this machine."""
    import time

    env = {**os.environ, "PYTHONPATH": pythonpath(), "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9"}
    for var in ("HF_HUB_OFFLINE", "MINICPM_DEBUG", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(var, None)
    p = subprocess.Popen([sys.executable, "-m", "minicpm_cli", "say", "Hi.", "-o", str(tmp_path / "x.wav"),
                          "--local", "--device", "cpu"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    first = p.stderr.readline().decode()
    said = time.monotonic()
    rest = p.stderr.read().decode()
    p.wait(timeout=120)
    elapsed = time.monotonic() - said
    assert first.startswith("minicpm: fetching openbmb/MiniCPM-o-2_6"), first + rest
    assert p.returncode == 1 and rest.startswith("minicpm: error: ") and len(rest.splitlines()) == 1, rest
    assert "cannot be reached" in rest, rest
    assert elapsed < 10, elapsed


def test_random_weights_without_the_memory_is_one_line(monkeypatch):
    """`bench --random-weights` where the full-size model does not fit: refused before anything is
    drawn (the free memory faked small), not an allocator's traceback."""
    from typer.testing import CliRunner

    from minicpm_cli.cli.app import app
    from minicpm_cli.engine import pipeline
    from minicpm_cli.errors import DeviceError

    monkeypatch.setattr(pipeline, "free_memory", lambda device: 2**30)
    r = CliRunner().invoke(app, ["bench", "--random-weights", "-b", "eager", "--device", "cpu", "--runs", "1",
                                 "--workload", "read"])
    assert isinstance(r.exception, DeviceError), r.output
    assert "GiB of memory and 1.0 GiB are free" in str(r.exception)


def test_out_of_memory_is_one_line(monkeypatch, capsys):
    import torch

    from minicpm_cli.cli import app

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(app, "app", oom)
    monkeypatch.delenv("MINICPM_DEBUG", raising=False)
    import signal

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as e:
            app.main()
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("minicpm: error: out of memory") and len(err.splitlines()) == 1, err


def test_torch_no_cuda_runtime_warning_stays_off_stderr():
    """torch's warning for a CUDA toolkit without a GPU (a CPU run on a GPU machine's image) is noise
    to a user of the CLI: the command line filters it, other warnings of that logger pass."""
    code = ("import logging, minicpm_cli.cli.app\nlog = logging.getLogger('torch.utils.cpp_extension')\n"
            "log.warning(\"No CUDA runtime is found, using CUDA_HOME='/usr/local/cuda'\")\nlog.warning('other')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": pythonpath()})
    assert p.returncode == 0, p.stderr
    assert p.stderr.strip() == "other", p.stderr
