"""Saved voices: `minicpm voice add|list|rm` as a user runs them (a subprocess with its own
XDG_DATA_HOME), what a saved voice holds, atomic writes, names, and what `--voice REF` resolves to."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from minicpm_cli.voices import store as voice_store
from minicpm_cli.errors import OptionError, VoiceError
from minicpm_cli.voices.reference import load_reference
from minicpm_cli.voices.store import VoiceExists, VoiceStore, default_dir, resolve

from conftest import FIXTURES, pythonpath

REF = FIXTURES / "voice_ref_a.wav"


def minicpm(*args: str, data: Path, cwd: Path | None = None, stdin: bytes | None = None):
    env = {**os.environ, "PYTHONPATH": pythonpath(), "XDG_DATA_HOME": str(data), "MINICPM_SERVER": ""}
    env.pop("MINICPM_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "minicpm_cli", *args], capture_output=True, env=env, cwd=cwd,
                          timeout=120, input=stdin)


def one_line_error(p, *needles: str, status: int = 1) -> str:
    err = p.stderr.decode()
    lines = [line for line in err.splitlines() if line.strip()]
    assert p.returncode == status and len(lines) == 1 and lines[0].startswith("minicpm: error: "), err
    assert "Traceback" not in err and p.stdout == b""
    for n in needles:
        assert n in lines[0], err
    return lines[0]


def tone(path: Path, seconds: float, amp: float = 0.5, rate: int = 16000) -> Path:
    t = np.arange(int(seconds * rate)) / rate
    sf.write(path, (amp * np.sin(2 * np.pi * 330 * t)).astype(np.float32), rate, format="WAV", subtype="FLOAT")
    return path


def listing(data: Path) -> list[str]:
    d = data / "minicpm" / "voices"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_add_list_rm(tmp_path):
    data = tmp_path / "data"
    p = minicpm("voice", "list", data=data)
    assert p.returncode == 0 and p.stdout == b"" and b"no saved voices" in p.stderr
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    p = minicpm("voice", "add", "alice", str(REF), data=data)
    assert p.returncode == 0 and p.stdout == b"", p.stderr.decode()
    assert p.stderr.decode() == f"minicpm: saved voice 'alice' (2.4 s) in {data / 'minicpm' / 'voices'}\n"
    p = minicpm("voice", "add", "bob_2", str(tone(tmp_path / "b.wav", 1.0, rate=22050)), data=data)
    assert p.returncode == 0, p.stderr.decode()
    assert listing(data) == ["alice.wav", "bob_2.wav"]  # (no temporary file left)
    umask = os.umask(0)
    os.umask(umask)
    assert (data / "minicpm" / "voices" / "alice.wav").stat().st_mode & 0o777 == 0o666 & ~umask  # (not mkstemp's 0600)

    p = minicpm("voice", "list", data=data)
    assert p.returncode == 0 and p.stderr == b""
    rows = [line.split() for line in p.stdout.decode().splitlines()]
    assert rows[0] == ["NAME", "SECONDS", "ADDED", "FROM"]
    assert [r[0] for r in rows[1:]] == ["alice", "bob_2"] and [r[1] for r in rows[1:]] == ["2.4", "1.0"]
    assert [r[-1] for r in rows[1:]] == ["voice_ref_a.wav", "b.wav"]
    added = datetime.datetime.strptime(" ".join(rows[1][2:4]), "%Y-%m-%d %H:%M").astimezone()
    assert before - datetime.timedelta(minutes=1) <= added <= datetime.datetime.now(datetime.timezone.utc)

    p = minicpm("voice", "rm", "alice", data=data)
    assert p.returncode == 0 and p.stdout == b""
    assert listing(data) == ["bob_2.wav"]
    one_line_error(minicpm("voice", "rm", "alice", data=data), "no saved voice 'alice'", "saved voices: bob_2")
    one_line_error(minicpm("voice", "rm", "../bob_2", data=data), "'../bob_2' cannot name a voice", status=2)


def test_a_saved_voice_is_the_reference_as_load_reference_reads_it(tmp_path):
    """Bit for bit, whatever the recording's rate and channels: a float WAV of the 16 kHz samples."""
    store = VoiceStore(tmp_path)
    stereo = tmp_path / "stereo.flac"
    t = np.arange(44100 * 2) / 44100
    sf.write(stereo, np.stack([0.4 * np.sin(2 * np.pi * 200 * t), 0.2 * np.sin(2 * np.pi * 310 * t)], axis=1),
             44100, subtype="PCM_24")
    for name, source in (("a", REF), ("b", stereo)):
        saved = store.add(name, source)
        expected = load_reference(source)
        info = sf.info(saved.path)
        assert (info.samplerate, info.channels, info.subtype) == (16000, 1, "FLOAT")
        assert saved.seconds == len(expected) / 16000 and saved.source == Path(source).name
        stored, _ = sf.read(saved.path, dtype="float32")
        np.testing.assert_array_equal(stored, expected)
        np.testing.assert_array_equal(store.load(name).samples, expected)
        assert store.load(name).digest == resolve(str(source)).digest
    assert store.names() == ["a", "b"] and [v.name for v in store.list()] == ["a", "b"]


def test_replacing_needs_force_and_a_refused_add_changes_nothing(tmp_path):
    data = tmp_path / "data"
    assert minicpm("voice", "add", "me", str(REF), data=data).returncode == 0
    path = data / "minicpm" / "voices" / "me.wav"
    first = path.read_bytes()
    other = tone(tmp_path / "other.wav", 1.5)
    one_line_error(minicpm("voice", "add", "me", str(other), data=data), "'me' is saved already", "--force")
    assert path.read_bytes() == first
    p = minicpm("voice", "add", "me", str(other), "--force", data=data)
    assert p.returncode == 0, p.stderr.decode()
    np.testing.assert_array_equal(sf.read(path, dtype="float32")[0], load_reference(other))
    assert listing(data) == ["me.wav"]


@pytest.mark.parametrize("case,message", [
    ("long", "at most 30 s"), ("short", "at least 0.5 s"), ("silent", "silent"), ("missing", "no such file"),
    ("text", "not audio that soundfile can read"), ("directory", "is a directory"),
])
def test_unusable_recordings_are_refused_and_nothing_is_written(tmp_path, case, message):
    data = tmp_path / "data"
    (tmp_path / "notes.wav").write_text("not audio")
    path = {"long": lambda: tone(tmp_path / "long.wav", 31.0), "short": lambda: tone(tmp_path / "short.wav", 0.4),
            "silent": lambda: tone(tmp_path / "silent.wav", 2.0, amp=5e-4), "missing": lambda: tmp_path / "none.wav",
            "text": lambda: tmp_path / "notes.wav", "directory": lambda: tmp_path}[case]()
    line = one_line_error(minicpm("voice", "add", "x", str(path), data=data), message)
    assert str(path) in line
    assert listing(data) == []
    if case == "short":  # the same refusal when a saved voice is being replaced: the old one stays
        assert minicpm("voice", "add", "x", str(REF), data=data).returncode == 0
        one_line_error(minicpm("voice", "add", "x", str(path), "--force", data=data), message)
        assert minicpm("voice", "list", data=data).stdout.decode().split()[4:6] == ["x", "2.4"]


@pytest.mark.parametrize("name", ["a/b", "../up", ".hidden", "-dash", "sp ace", "é", "x" * 65, "default", ""])
def test_bad_names_are_usage_errors(tmp_path, name):
    data = tmp_path / "data"
    expected = "model's own voice" if name == "default" else "cannot name a voice"
    one_line_error(minicpm("voice", "add", "--", name, str(REF), data=data), expected, status=2)
    assert listing(data) == []
    assert not (data / "minicpm" / "up.wav").exists()


def test_the_longest_name_and_every_kind_of_character_are_accepted(tmp_path):
    store = VoiceStore(tmp_path)
    for name in ("x" * 64, "A-b_9", "7", "Default"):
        store.add(name, REF)
    assert store.names() == sorted(["x" * 64, "A-b_9", "7", "Default"])


def test_usage_errors_of_the_voice_commands_exit_2(tmp_path):
    data = tmp_path / "data"
    assert minicpm("voice", "add", "x", data=data).returncode == 2  # no FILE
    assert minicpm("voice", "rm", data=data).returncode == 2
    assert minicpm("voice", "frob", data=data).returncode == 2
    assert listing(data) == []


def test_writes_are_atomic(tmp_path, monkeypatch):
    """A failure while writing or renaming leaves neither the voice nor a temporary file; a name taken
    by another writer between the check and the rename is not overwritten (the rename is a link that
    fails if the name exists)."""
    store = VoiceStore(tmp_path / "voices")
    store.add("keep", REF)
    kept = (store.root / "keep.wav").read_bytes()
    other = tone(tmp_path / "t.wav", 1.0)

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(voice_store.os, "replace", broken)
    with pytest.raises(OSError, match="No space left"):
        store.add("keep", other, force=True)
    monkeypatch.undo()
    assert sorted(p.name for p in store.root.iterdir()) == ["keep.wav"]
    assert (store.root / "keep.wav").read_bytes() == kept

    monkeypatch.setattr(store, "_free", lambda name: None)  # as if another process added it after the check
    with pytest.raises(VoiceExists):
        store.add("keep", other)
    assert sorted(p.name for p in store.root.iterdir()) == ["keep.wav"]
    assert (store.root / "keep.wav").read_bytes() == kept
    store.add("new", other)  # (and a free name is taken by that same link)
    assert store.names() == ["keep", "new"]


def test_the_directory_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_dir() == tmp_path / "xdg" / "minicpm" / "voices"
    for unset in ("", "relative/dir"):
        monkeypatch.setenv("XDG_DATA_HOME", unset)
        assert default_dir() == tmp_path / "home" / ".local" / "share" / "minicpm" / "voices"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_dir() == tmp_path / "home" / ".local" / "share" / "minicpm" / "voices"
    assert VoiceStore().root == default_dir() and VoiceStore().names() == []  # (no directory yet: no voices)


def test_what_voice_ref_names(tmp_path, monkeypatch):
    """An existing file wins; else `default` is the model's own voice (None); else a saved voice; else
    an error that names both possibilities."""
    store = VoiceStore(tmp_path / "voices")
    store.add("alice", REF)
    monkeypatch.chdir(tmp_path)
    assert resolve("alice", store).digest == store.load("alice").digest
    assert resolve("default", store) is None
    tone(tmp_path / "alice", 1.0)  # a file of that name in the working directory
    assert resolve("alice", store).digest != store.load("alice").digest
    assert len(resolve("alice", store).samples) == 16000
    with pytest.raises(VoiceError) as e:
        resolve("bob.wav", store)
    assert str(e.value) == "bob.wav: no such file, and no saved voice has that name (saved voices: alice)"
    with pytest.raises(VoiceError, match=r"no voices are saved \(minicpm voice add NAME FILE\)"):
        resolve("bob", VoiceStore(tmp_path / "empty"))
    with pytest.raises(VoiceError, match="is a directory"):
        resolve(str(tmp_path), store)


def test_a_recording_from_a_pipe_is_read_once(tmp_path):
    """`voice add me /dev/stdin < rec.wav`, `--voice <(ffmpeg ...)`: a pipe is read once, into memory,
    giving the file's samples (soundfile read its header, then opened it again and found nothing:
    "Format not recognised"; and --voice resolved the pipe's name to /proc/N/fd/pipe:[...], no file)."""
    data = tmp_path / "data"
    p = minicpm("voice", "add", "piped", "/dev/stdin", data=data, stdin=REF.read_bytes())
    assert p.returncode == 0, p.stderr.decode()
    saved = VoiceStore(data / "minicpm" / "voices")
    np.testing.assert_array_equal(saved.load("piped").samples, load_reference(REF))
    assert saved.get("piped").source == ""  # (no file's name to keep)
    code = "from minicpm_cli.voices.store import resolve\nprint(resolve('/dev/stdin').digest)\n"
    p = subprocess.run([sys.executable, "-c", code], input=REF.read_bytes(), capture_output=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": pythonpath(), "XDG_DATA_HOME": str(data)})
    assert p.returncode == 0, p.stderr.decode()
    assert p.stdout.decode().strip() == resolve(str(REF)).digest


def test_a_damaged_saved_voice_is_one_line_naming_it(tmp_path):
    store = VoiceStore(tmp_path)
    store.add("ok", REF)
    (tmp_path / "bad.wav").write_bytes(b"RIFF....WAVE")
    (tmp_path / "no name.wav").write_bytes(b"")  # not a name: not a voice
    assert store.names() == ["bad", "ok"]
    with pytest.raises(VoiceError, match=r"saved voice 'bad'"):
        store.load("bad")
    data = tmp_path / "xdg"
    (data / "minicpm").mkdir(parents=True)
    (data / "minicpm" / "voices").symlink_to(tmp_path)
    p = minicpm("voice", "list", data=data)
    assert p.returncode == 0 and p.stdout.decode().split()[4] == "ok"
    assert p.stderr.decode().startswith("minicpm: warning: saved voice 'bad'")
    with pytest.raises(OptionError):
        store.path("no name")


def test_the_store_imports_no_torch():
    code = ("import sys\nfrom minicpm_cli.voices import store\nfrom minicpm_cli.cli import app\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, env={**os.environ, "PYTHONPATH": pythonpath()})
    assert p.returncode == 0, p.stderr.decode()


def test_one_rule_for_every_place_a_voice_is_named(tmp_path, monkeypatch):
    """`locate` is the rule `say --voice`, the server's `voice` (names only, OpenAI's too) and bulk's
    voice column share: the server never reads a file a client names; OpenAI's names speak the
    model's own voice unless a saved voice has the name."""
    from minicpm_cli.voices.store import UnknownVoice, locate

    store = VoiceStore(tmp_path / "voices")
    store.add("alice", REF)
    store.add("nova", REF)
    monkeypatch.chdir(tmp_path)
    tone(tmp_path / "here.wav", 1.0)
    assert locate("here.wav", store) == tmp_path / "here.wav"
    assert locate("alice", store) == store.path("alice")
    assert locate("default", store) is None and locate("default", store, files=False) is None
    with pytest.raises(UnknownVoice):
        locate("here.wav", store, files=False, openai_names=True)  # (a file on the server's disk: never)
    assert locate("alloy", store, files=False, openai_names=True) is None
    assert locate("nova", store, files=False, openai_names=True) == store.path("nova")  # (saved wins)
    with pytest.raises(UnknownVoice, match="unknown voice 'alloy'"):
        locate("alloy", store, files=False)
    assert resolve("nova", store, files=False, openai_names=True).digest == store.load("nova").digest


def test_bulk_voice_column_takes_what_say_voice_takes(tmp_path):
    """A saved voice's name, `default`, or a recording relative to INPUT's folder (docs/scale-out.md)."""
    from minicpm_cli.errors import UsageError
    from minicpm_cli.scale import bulk

    store = VoiceStore(tmp_path / "voices")
    store.add("alice", REF)
    tone(tmp_path / "rec.wav", 1.0)
    rows = [{"text": "a", "voice": "alice"}, {"text": "b", "voice": "default"}, {"text": "c", "voice": "rec.wav"},
            {"text": "d"}]
    items = bulk.plan(rows, fmt="wav", greedy=True, seed=None, base=tmp_path, store=store)
    assert [i.voice for i in items] == [str(store.path("alice")), None, str(tmp_path / "rec.wav"), None]
    with pytest.raises(UsageError, match="item 1: .*no saved voice has that name"):
        bulk.plan([{"text": "a", "voice": "bob"}], fmt="wav", greedy=True, seed=None, base=tmp_path, store=store)
