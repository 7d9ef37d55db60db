"""The CLI as a user runs it: a subprocess, its exit status, its stdout bytes and its stderr lines."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file

from conftest import pythonpath


def run(*args: str, stdin: bytes | None = None, env: dict | None = None, cwd: Path | None = None):
    e = {**os.environ, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1", **(env or {})}
    e.pop("MINICPM_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "minicpm_cli", *args], input=stdin if stdin is not None else b"",
                          capture_output=True, env=e, cwd=cwd, timeout=300)


def assert_one_line_error(p, *needles: str):
    err = p.stderr.decode()
    assert p.returncode == 1, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("minicpm: error: "), err
    for n in needles:
        assert n in lines[0], err
    assert p.stdout == b""


def test_help_does_not_import_torch():
    code = (
        "import sys\nsys.argv = ['minicpm', '--help']\nfrom minicpm_cli.cli.app import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported by --help'\nprint('ok', file=sys.stderr)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, env={**os.environ, "PYTHONPATH": pythonpath()})
    assert p.returncode == 0, p.stderr.decode()
    assert b"say" in p.stdout


def test_say_reproduces_golden_waveform(tiny_dir, goldens, manifest, tmp_path):
    """The exact command of the parity criterion: float32 WAV equal to the reference's waveform."""
    text = manifest["read"][0]["text"]
    out = tmp_path / "x.wav"
    p = run("say", text, "--model", str(tiny_dir), "--greedy", "--device", "cpu", "--dtype", "float32",
            "--pcm", "f32", "-o", str(out))
    assert p.returncode == 0, p.stderr.decode()
    assert p.stdout == b""
    audio, sr = sf.read(out, dtype="float32")
    info = sf.info(out)
    assert (sr, info.subtype, info.channels) == (24000, "FLOAT", 1)
    np.testing.assert_allclose(audio, goldens["read_short_wav"], atol=1e-4, rtol=0)
    assert [f.name for f in tmp_path.iterdir()] == ["x.wav"]  # no temporary file left


def _streamed(codec, codes):
    """The reference's streamed decode of `codes` (25-frame steps, crossfaded), concatenated."""
    from minicpm_cli.engine.codec import StreamDecoder

    dec = StreamDecoder(codec, hold_first=False)
    parts = [dec.feed(torch.as_tensor(codes[i : i + 25])) for i in range(0, len(codes), 25)]
    return torch.cat([p for p in parts if p is not None] + [dec.flush()]).numpy()


def test_say_stdin_to_stdout_streams_and_file_is_one_call(tiny_dir, goldens, codec, tmp_path):
    """Stdout gets the streamed decode (chunks crossfaded as the reference streams); a file gets the
    one-call decode of the read-aloud path. Same codes either way."""
    p = run("say", "--model", str(tiny_dir), "--greedy", "--device", "cpu", "-o", "-", stdin=b"Hello world.\n")
    assert p.returncode == 0, p.stderr.decode()
    audio, sr = sf.read(io.BytesIO(p.stdout), dtype="int16")
    assert sr == 24000 and audio.dtype == np.int16
    expected = np.round(np.clip(_streamed(codec, goldens["read_short_codes"]), -1, 1) * 32767).astype(np.int16)
    assert len(audio) == len(expected)
    assert np.abs(audio.astype(np.int32) - expected).max() <= 1
    dash = run("say", "-", "--model", str(tiny_dir), "--greedy", "--device", "cpu", "-o", "-", stdin=b"Hello world.\n")
    assert dash.returncode == 0 and dash.stdout == p.stdout, dash.stderr.decode()  # (`say -`: stdin, as -f - reads it)
    flac = tmp_path / "x.flac"
    p = run("say", "Hello world.", "--model", str(tiny_dir), "--greedy", "--device", "cpu", "-o", str(flac))
    assert p.returncode == 0, p.stderr.decode()
    assert sf.info(flac).format == "FLAC"
    one_call = np.round(np.clip(goldens["read_short_wav"], -1, 1) * 32767).astype(np.int16)
    assert np.abs(sf.read(flac, dtype="int16")[0].astype(np.int32) - one_call).max() <= 1


def test_missing_model_directory(tmp_path):
    out = tmp_path / "x.wav"
    p = run("say", "Hi.", "--model", str(tmp_path / "nope"), "--device", "cpu", "-o", str(out))
    assert_one_line_error(p, "model directory not found", "nope")
    assert not out.exists()


def test_uncached_repo_while_offline(tmp_path):
    out = tmp_path / "x.wav"
    p = run("say", "Hi.", "--model", "someone/not-cached", "--device", "cpu", "-o", str(out),
            env={"HF_HOME": str(tmp_path / "hf")})
    assert_one_line_error(p, "someone/not-cached", "HF_HUB_OFFLINE")
    assert not out.exists()


@pytest.fixture
def broken_copy(tiny_dir, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, dst)
    return dst


def test_truncated_safetensors(broken_copy, tmp_path):
    f = broken_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    out = tmp_path / "x.wav"
    p = run("say", "Hi.", "--model", str(broken_copy), "--device", "cpu", "-o", str(out))
    assert_one_line_error(p, "model.safetensors")
    assert not out.exists()


def test_tensor_of_wrong_shape(broken_copy, tmp_path):
    f = broken_copy / "model.safetensors"
    sd = load_file(f)
    name = "tts.model.layers.1.mlp.up_proj.weight"
    sd[name] = sd[name][:, :-1].contiguous()
    save_file(sd, f, metadata={"format": "pt"})
    out = tmp_path / "x.wav"
    p = run("say", "Hi.", "--model", str(broken_copy), "--device", "cpu", "-o", str(out))
    assert_one_line_error(p, name, "shape")
    assert not out.exists()


def test_missing_tensor(broken_copy, tmp_path):
    f = broken_copy / "model.safetensors"
    sd = load_file(f)
    del sd["llm.model.layers.0.self_attn.k_proj.bias"]
    save_file(sd, f, metadata={"format": "pt"})
    p = run("say", "Hi.", "--model", str(broken_copy), "--device", "cpu", "-o", str(tmp_path / "x.wav"))
    assert_one_line_error(p, "llm.model.layers.0.self_attn.k_proj.bias")


@pytest.mark.parametrize("stdin", [b"", b"   \n\t\n"])
def test_empty_text(tiny_dir, tmp_path, stdin):
    out = tmp_path / "x.wav"
    p = run("say", "--model", str(tiny_dir), "--device", "cpu", "-o", str(out), stdin=stdin)
    assert_one_line_error(p, "no text")
    assert not out.exists()
    # to stdout: not even a WAV header before the error (a player downstream would take it for audio)
    assert_one_line_error(run("say", "--model", str(tiny_dir), "--device", "cpu", "-o", "-", stdin=stdin), "no text")
    # --lines: no line to speak is the same error, with no file left behind
    assert_one_line_error(run("say", "--lines", "--model", str(tiny_dir), "--device", "cpu", "-o", str(out),
                              stdin=stdin), "no text")
    assert not out.exists()
    assert_one_line_error(run("say", "--lines", "--dir", str(tmp_path / "d"), "--model", str(tiny_dir), "--device",
                              "cpu", stdin=stdin), "no text")
    assert list((tmp_path / "d").iterdir()) == []


def test_say_with_a_terminal_on_stderr_shows_its_progress(tiny_dir, tmp_path):
    """The user's usual case: stderr on a terminal, where the progress bar runs (a bar of no total once
    failed `say` with a traceback, which the suite, never on a terminal, did not see)."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    out = tmp_path / "x.wav"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # (a new pty is 0 columns wide)
    env = {**os.environ, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1", "MINICPM_SERVER": ""}
    p = subprocess.Popen([sys.executable, "-m", "minicpm_cli", "say", "Hello there.", "--model", str(tiny_dir),
                          "--device", "cpu", "-o", str(out)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=slave, env=env)
    os.close(slave)
    seen, deadline = [], time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    data = os.read(master, 4096)
                except OSError:  # (EIO: the child closed the terminal)
                    break
                if not data:
                    break
                seen.append(data)
            elif p.poll() is not None:
                break
        p.wait(timeout=30)
    finally:
        os.close(master)
        p.kill()
    err = b"".join(seen).decode(errors="replace")
    assert p.returncode == 0, err
    assert "Traceback" not in err and "speaking" in err, err
    assert p.stdout.read() == b""
    assert sf.info(out).frames > 0


def test_wav_on_stdout_into_a_file_gets_its_sizes(tiny_dir, tmp_path):
    """`say TEXT > f.wav`: stdout is a regular file, so the header's sizes are written at the end (a
    pipe keeps "unknown length"; a file opened to append, where every write goes to the end, too)."""
    import struct
    import wave

    args = [sys.executable, "-m", "minicpm_cli", "say", "Hi there.", "--model", str(tiny_dir), "--device", "cpu",
            "--greedy", "-o", "-"]
    env = {**os.environ, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1", "MINICPM_SERVER": ""}
    f = tmp_path / "x.wav"
    with open(f, "wb") as out:
        out.write(b"before")  # (the header where the stream was, not at the file's start)
        out.flush()
        assert subprocess.run(args, stdout=out, env=env, timeout=300).returncode == 0
    data = f.read_bytes()[6:]
    riff, size = struct.unpack("<I", data[4:8])[0], struct.unpack("<I", data[40:44])[0]
    assert size == len(data) - 44 > 0 and riff == size + 36
    with wave.open(io.BytesIO(data)) as w:
        assert w.getnframes() == size // 2
    piped = run("say", "Hi there.", "--model", str(tiny_dir), "--device", "cpu", "--greedy", "-o", "-")
    assert piped.stdout[4:8] == piped.stdout[40:44] == b"\xff" * 4 and piped.stdout[44:] == data[44:]
    g = tmp_path / "y.wav"
    with open(g, "ab") as out:
        assert subprocess.run(args, stdout=out, env=env, timeout=300).returncode == 0
    assert g.read_bytes() == piped.stdout


def test_a_named_pipe_or_a_device_is_written_in_place_as_stdout_is(tiny_dir, tmp_path):
    """-o /dev/stdout or a named pipe (mkfifo): the bytes -o - writes, written in place (they were
    taken for files: a pipe was replaced by a regular file made beside it, its reader left waiting,
    and --raw -o /dev/null would have replaced /dev/null; /dev/stdout on a pipe was 'cannot write in
    /proc/N/fd'). FLAC, which needs a file, is refused."""
    from test_usage_errors import assert_usage_error

    args = ("say", "Hi there.", "--model", str(tiny_dir), "--device", "cpu", "--greedy")
    piped = run(*args, "-o", "-")
    assert piped.returncode == 0 and piped.stdout[:4] == b"RIFF", piped.stderr.decode()
    dev = run(*args, "-o", "/dev/stdout")
    assert dev.returncode == 0 and dev.stdout == piped.stdout, dev.stderr.decode()
    raw = run(*args, "--raw", "-o", "/dev/stdout")
    assert raw.returncode == 0 and raw.stdout == piped.stdout[44:], raw.stderr.decode()
    fifo = tmp_path / "pipe.wav"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    try:
        p = run(*args, "-o", str(fifo))
        got = reader.communicate(timeout=30)[0]
    finally:
        reader.kill()
    assert p.returncode == 0 and p.stdout == b"", p.stderr.decode()
    assert got == piped.stdout and fifo.is_fifo()
    assert list(tmp_path.iterdir()) == [fifo]
    os.mkfifo(tmp_path / "pipe.flac")
    assert_usage_error(run(*args, "-o", str(tmp_path / "pipe.flac")), "not a regular file", "FLAC")
    # stdout a regular file (here opened to append, `>> log`): /dev/stdout names the descriptor, written
    # as -o - writes it (the file was taken by its name: no format, or with --raw replaced, not appended to)
    env = {**os.environ, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1", "MINICPM_SERVER": ""}
    logs = []
    for target in ("-", "/dev/stdout"):
        log = tmp_path / f"log-{len(logs)}"
        log.write_bytes(b"before")
        with open(log, "ab") as out:
            p = subprocess.run([sys.executable, "-m", "minicpm_cli", *args, "-o", target], stdout=out,
                               stderr=subprocess.PIPE, env=env, timeout=300)
        assert p.returncode == 0, p.stderr.decode()
        logs.append(log.read_bytes())
    assert logs[0] == logs[1] == b"before" + piped.stdout


def test_reply_text_to_stdout(tiny_dir, tmp_path):
    out = tmp_path / "r.wav"
    p = run("reply", "Hi", "--model", str(tiny_dir), "--device", "cpu", "--max-tokens", "12", "--seed", "3",
            "--text-out", "-", "-o", str(out))
    assert p.returncode == 0, p.stderr.decode()
    q = run("reply", "Hi", "--model", str(tiny_dir), "--device", "cpu", "--max-tokens", "12", "--seed", "3",
            "--text-out", str(tmp_path / "t.txt"), "-o", str(tmp_path / "s.wav"))
    assert q.returncode == 0, q.stderr.decode()
    assert p.stdout.decode() == (tmp_path / "t.txt").read_text(encoding="utf-8") != "\n"
    assert not (tmp_path / "-").exists()
    assert out.read_bytes() == (tmp_path / "s.wav").read_bytes()


def test_a_config_without_a_field_is_one_line(broken_copy, tmp_path):
    import json

    f = broken_copy / "config.json"
    config = json.loads(f.read_text())
    del config["hidden_size"]
    f.write_text(json.dumps(config))
    p = run("say", "Hi.", "--model", str(broken_copy), "--device", "cpu", "-o", str(tmp_path / "x.wav"))
    assert_one_line_error(p, "config.json lacks the field 'hidden_size'")
    f.write_text("[1, 2]")
    assert_one_line_error(run("say", "Hi.", "--model", str(broken_copy), "--device", "cpu", "-o",
                              str(tmp_path / "x.wav")), "not a JSON object")
    assert not (tmp_path / "x.wav").exists()


def test_text_that_is_not_utf8_is_one_line(tiny_dir, tmp_path):
    """A Latin-1 byte in an argument, on stdin or in a file (Python keeps it as a lone surrogate,
    which the tokenizers refused with a TypeError traceback)."""
    out, model = str(tmp_path / "x.wav"), ("--model", str(tiny_dir), "--device", "cpu")
    p = subprocess.run([sys.executable, "-m", "minicpm_cli", "say", b"Caf\xe9 au lait.", *model, "-o", out],
                       capture_output=True, env={**os.environ, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1"},
                       timeout=300)
    assert_one_line_error(p, "the text is not UTF-8: byte 0xE9 at character 4")
    assert_one_line_error(run("reply", *model, "-o", out, stdin=b"Caf\xe9?\n"), "standard input is not UTF-8")
    assert_one_line_error(run("say", "--lines", *model, "-o", out, stdin=b"One.\nCaf\xe9.\n"),
                          "standard input's line 2 is not UTF-8")
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"One.\nCaf\xe9.\n")
    assert_one_line_error(run("say", "--lines", "-f", str(latin), *model, "-o", out), "latin.txt is not UTF-8 text (line 2)")
    assert not (tmp_path / "x.wav").exists()


def test_a_byte_order_mark_is_not_spoken(tiny_dir, tmp_path):
    """A UTF-8 file that begins with a byte order mark (as Windows' Notepad saves one), read with -f,
    --lines -f or on standard input: the text without the mark is spoken (the mark was given to the
    model as text, and the audio differed from the same text's)."""
    model = ("--model", str(tiny_dir), "--device", "cpu", "--greedy", "-o", "-")
    plain = run("say", "Hello there.", *model)
    assert plain.returncode == 0, plain.stderr.decode()
    f = tmp_path / "notepad.txt"
    f.write_bytes(b"\xef\xbb\xbfHello there.\r\n")
    for args, stdin in ((("-f", str(f)), None), ((), f.read_bytes()), (("--lines", "-f", str(f)), None),
                        (("--lines",), f.read_bytes())):
        p = run("say", *args, *model, stdin=stdin)
        assert p.returncode == 0 and p.stdout == plain.stdout, (args, p.stderr.decode())


def test_an_empty_voice_is_one_line(tiny_dir, tmp_path):
    p = run("say", "Hi.", "--model", str(tiny_dir), "--device", "cpu", "--voice", "", "-o", str(tmp_path / "x.wav"))
    assert_one_line_error(p, "an empty voice")


def test_bad_options_are_one_line_errors(tiny_dir, tmp_path):
    # an option's value out of its range, or options that do not go together: exit 2, as the parser's own
    from test_usage_errors import assert_usage_error

    assert_usage_error(run("say", "Hi.", "--model", str(tiny_dir), "-o", str(tmp_path / "x.mp3")), ".mp3")
    assert_usage_error(run("say", "Hi.", "--model", str(tiny_dir), "--pcm", "f32", "-o", str(tmp_path / "x.flac")), "FLAC")
    assert_usage_error(run("say", "Hi.", "--backend", "nope", "-o", str(tmp_path / "x.wav")), "unknown backend", "eager")
    assert_usage_error(run("say", "Hi.", "--model", str(tiny_dir), "--dtype", "int3", "--device", "cpu",
                           "-o", str(tmp_path / "x.wav")), "int3")
    assert list(tmp_path.iterdir()) == []


def test_parser_errors_exit_2():
    p = run("say", "--no-such-option")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr.decode()


def test_vision_and_audio_weights_are_never_read(tiny_dir, tmp_path):
    """A sharded checkpoint whose vision/audio-encoder shard is gone still speaks: that shard is
    never opened (the index alone tells which shards hold llm.* and tts.*)."""
    import json as _json

    from minicpm_cli.engine.synthetic import SyntheticSpec, write_checkpoint

    ckpt = write_checkpoint(tmp_path / "ckpt", SyntheticSpec.tiny(), tokenizer_from=tiny_dir,
                            max_shard_bytes=4 << 20, include_vision_audio=True)
    index = _json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    other = {f for k, f in index.items() if not k.startswith(("llm.", "tts."))}
    speech = {f for k, f in index.items() if k.startswith(("llm.", "tts."))}
    assert other and not other & speech
    for f in other:
        (ckpt / f).unlink()
    out = tmp_path / "x.wav"
    p = run("say", "Hello world.", "--model", str(ckpt), "--greedy", "--device", "cpu", "-o", str(out))
    assert p.returncode == 0, p.stderr.decode()
    assert sf.info(out).frames > 0


def test_option_conflicts_exit_2(tiny_dir, tmp_path):
    """Options that cannot go together are usage errors: one line, exit 2, nothing written."""
    cases = [
        (("--greedy", "--seed", "3"), "--greedy takes no --seed"),
        (("--first-chunk", "0"), "--first-chunk"),
        (("--gguf", "x.gguf", "--backend", "eager"), "--gguf is for --backend gguf"),
    ]
    for extra, needle in cases:
        p = run("say", "Hi.", "--model", str(tiny_dir), "--device", "cpu", "-o", str(tmp_path / "x.wav"), *extra)
        err = p.stderr.decode()
        assert p.returncode == 2, err
        assert err.strip().startswith("minicpm: error: ") and needle in err and len(err.strip().splitlines()) == 1, err
    p = run("reply", "Hi.", "--model", str(tiny_dir), "--greedy", "--seed", "1", "-o", str(tmp_path / "y.wav"))
    assert p.returncode == 2 and "--greedy takes no --seed" in p.stderr.decode()
    assert list(tmp_path.iterdir()) == []


def test_version_and_backends_listing():
    from minicpm_cli import __version__

    p = run("--version")
    assert p.returncode == 0 and p.stdout.decode().strip() == f"minicpm {__version__}"
    p = run("backends")
    assert p.returncode == 0, p.stderr.decode()
    out = p.stdout.decode()
    for name in ("eager", "compile", "int4", "gguf"):
        assert out.count(f"\n{name} ") + out.startswith(f"{name} ") == 1, out
    # true descriptions: the ones the issue found stale are gone, and each backend says what it costs
    assert "torch's int4 kernel, on the compile path" not in out and "torch.compile and CUDA graphs" not in out
    assert "Triton" in out and "GPTQ" in out
    help_ = run("say", "--help").stdout.decode()
    assert "auto (default)" in help_ and "int4:" in help_


def test_backend_descriptions_carry_no_measured_figures():
    """What a backend is and costs, in words that stay true: timings, speed-ups, sizes and GPU names
    go stale (they belong in docs/benchmarks.md)."""
    from minicpm_cli import backends

    figure = re.compile(r"\d\s*(?:ms|s|GiB|GB|MB|x|%)(?!\w)|\bRTF\b|tokens/s|\b(?:[AHL]\d{2,3}S?|RTX)\b")
    for b in backends.REGISTRY.values():
        assert b.summary and b.cost, b.name
        for text in (b.summary, b.cost):
            assert not figure.search(text), (b.name, figure.search(text).group(), text)
    assert "batch-invariant" in backends.get("eager").cost
    assert not figure.search(backends.help_text())


def test_a_16_bit_wav_is_written_as_libsndfile_writes_it(tmp_path):
    """FileSink writes 16-bit WAV itself (so that samples a server converted need no numpy or
    libsndfile): the same bytes as libsndfile, from float chunks or from `Pcm`, whatever the lengths."""
    from minicpm_cli.audio import Pcm, open_sink, to_pcm

    rng = np.random.default_rng(0)
    for n in (0, 1, 2401, 24000 * 3 + 7):
        samples = (rng.standard_normal(n) * 0.6).astype(np.float32)  # (some beyond [-1, 1]: clipped)
        sf.write(tmp_path / "theirs.wav", to_pcm(samples, "s16"), 24000, format="WAV", subtype="PCM_16")
        theirs = (tmp_path / "theirs.wav").read_bytes()
        for kind in ("float", "pcm"):
            sink = open_sink(str(tmp_path / "ours.wav"), "s16", 24000)
            for part in np.array_split(samples, 5):
                sink.write(part if kind == "float" else Pcm(to_pcm(part, "s16").astype("<i2").tobytes(), "s16"))
            sink.close()
            assert (tmp_path / "ours.wav").read_bytes() == theirs, (n, kind)


def test_a_float_wav_is_the_same_bytes_whenever_it_is_written(tmp_path):
    """libsndfile stamps the time of writing into a float WAV's PEAK chunk; FileSink zeroes it, so the
    same samples written a second apart give the same file: libsndfile's with that stamp zeroed,
    which reads back as written."""
    import time

    from minicpm_cli.audio import open_sink

    samples = (np.random.default_rng(0).standard_normal(2401) * 0.6).astype(np.float32)
    files = []
    for i in range(2):
        if i:
            time.sleep(1.1)
        sink = open_sink(str(tmp_path / f"{i}.wav"), "f32", 24000)
        for part in np.array_split(samples, 3):
            sink.write(part)
        sink.close()
        files.append((tmp_path / f"{i}.wav").read_bytes())
    sf.write(tmp_path / "theirs.wav", samples, 24000, format="WAV", subtype="FLOAT")
    theirs = (tmp_path / "theirs.wav").read_bytes()
    at = theirs.find(b"PEAK", 12, 200)
    assert at > 0 and theirs[at + 12 : at + 16] != bytes(4)  # (libsndfile's own file: stamped)
    assert files[0] == files[1] == theirs[: at + 12] + bytes(4) + theirs[at + 16 :]
    back, rate = sf.read(tmp_path / "0.wav", dtype="float32")
    assert rate == 24000 and np.array_equal(back, samples)


@pytest.mark.parametrize("code, status, stderr", [("None", 0, ""), ("3", 3, ""), ("'bye'", 1, "bye\n")])
def test_leaving_without_teardown_keeps_the_status_and_the_output(code, status, stderr):
    """Without torch the CLI leaves by os._exit (entry._exit): sys.exit's status and everything written."""
    script = ("import sys\nfrom minicpm_cli.cli.entry import _exit\n"
              f"sys.stdout.write('out')\nsys.stdout.buffer.write(b' raw')\n_exit({code})\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, env={**os.environ, "PYTHONPATH": pythonpath()})
    assert (p.returncode, p.stdout, p.stderr.decode()) == (status, b"out raw", stderr)


def test_auto_backend_is_eager_on_a_cpu_and_says_so_with_v(tiny_dir, tmp_path):
    out = tmp_path / "x.wav"
    p = run("say", "Hello.", "--model", str(tiny_dir), "--greedy", "--device", "cpu", "-v", "-o", str(out))
    assert p.returncode == 0, p.stderr.decode()
    assert "backend eager" in p.stderr.decode()
    quiet = run("say", "Hello.", "--model", str(tiny_dir), "--greedy", "--device", "cpu", "-o", str(tmp_path / "y.wav"))
    assert quiet.returncode == 0 and quiet.stderr == b""
    assert (tmp_path / "y.wav").read_bytes() == out.read_bytes()


def test_auto_backend_choice(tmp_path):
    from minicpm_cli.backends import choose

    gptq = tmp_path / "int4"
    gptq.mkdir()
    (gptq / "quantize_config.json").write_text("{}")
    assert choose(str(gptq), "cuda", triton=True) == "int4"
    assert choose(str(gptq), "cpu") == "int4"
    assert choose("openbmb/MiniCPM-o-2_6-int4", "cuda", triton=True) == "int4"
    assert choose("openbmb/MiniCPM-o-2_6", "cuda", triton=True) == "compile"
    assert choose(None, "cuda", triton=False) == "eager"
    assert choose(None, "cpu", triton=True) == "eager"
    assert choose(str(tmp_path), "cuda", triton=True, gguf="x.gguf") == "gguf"


def test_a_ctrl_c_that_python_drops_is_raised_again(tmp_path):
    """A KeyboardInterrupt raised where CPython can only report it (here a weakref callback, as
    importlib's module locks have) is not lost: it is raised again in ordinary code, a blocking call
    interrupted as by a press, with no traceback and no second "interrupted" line; a later press is
    still ignored."""
    script = tmp_path / "drop.py"
    script.write_text(
        "import os, signal, sys, time, weakref\n"
        "from minicpm_cli.cli.signals import interrupt\n"
        "signal.signal(signal.SIGINT, interrupt)\n"
        "class Thing: pass\n"
        "def cb(ref):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"  # (the handler runs inside the callback)
        "    time.sleep(0.05)\n"
        "t = Thing(); r = weakref.ref(t, cb)\n"
        "try:\n"
        "    del t\n"
        "    time.sleep(20)\n"  # (one blocking call: the interrupt must end it too)
        "    print('ran on')\n"
        "except KeyboardInterrupt:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"  # (a second press: ignored)
        "    time.sleep(0.2)\n"
        "    print('raised again')\n")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": pythonpath()})
    assert proc.stdout.strip() == "raised again", (proc.stdout, proc.stderr)
    assert time.monotonic() - started < 15
    assert proc.stderr.strip() == "minicpm: interrupted", proc.stderr


def test_ctrl_c_at_any_moment_exits_130_without_traceback(tiny_dir, tmp_path):
    """SIGINT to the whole process group (what a terminal's Ctrl-C sends) during imports, loading and
    generation: exit 130 (or 0 if it had finished), never a traceback, never a partial file. Delays
    count from our entry point's first mark (a SIGINT before it lands in the interpreter's own
    start-up, which a loaded machine can stretch past 50 ms)."""
    import signal
    import time

    text = "This sentence is long enough to keep the tiny model busy for a little while. " * 3
    e = {**os.environ, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1"}
    e.pop("MINICPM_DEBUG", None)
    outcomes = set()
    for i, delay in enumerate((0.05, 0.3, 0.8, 1.5, 2.5, 4.0)):
        d = tmp_path / f"run{i}"
        d.mkdir()
        out = d / "x.wav"
        log = tmp_path / f"startup{i}.log"
        proc = subprocess.Popen([sys.executable, "-m", "minicpm_cli", "say", text, "--model", str(tiny_dir),
                                 "--device", "cpu", "--seed", "1", "-o", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**e, "MINICPM_STARTUP_LOG": str(log)}, start_new_session=True)
        started = time.monotonic()
        while not (log.exists() and log.stat().st_size) and time.monotonic() - started < 60:
            time.sleep(0.002)
        time.sleep(delay)
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
        stdout, stderr = proc.communicate(timeout=120)
        err = stderr.decode()
        assert "Traceback" not in err, (delay, err)
        assert stdout == b""
        assert proc.returncode in (0, 130), (delay, proc.returncode, err)
        if proc.returncode == 130:
            assert err.strip() == "minicpm: interrupted", (delay, err)
            assert list(d.iterdir()) == [], (delay, list(d.iterdir()))
        else:
            assert [p.name for p in d.iterdir()] == ["x.wav"] and sf.info(out).frames > 0
        outcomes.add(proc.returncode)
    assert 130 in outcomes
