"""`minicpm serve` and the thin client.

Real server processes on the tiny checkpoint (one per fixture, on a free port): the official `openai`
client gets what `minicpm say` makes in-process, byte for byte; `say`/`reply` through the server write
what `--local` writes; bad requests get OpenAI's error object with their status and the server stays
up; concurrency, disconnects, the API key, loading and SIGTERM. Then the server's application
in-process over a fake model, where queue order, cancellation and failures can be observed exactly.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import http.client
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import numpy as np
import pytest
import soundfile as sf

# the official client is the server's test client (the test extra)
openai = pytest.importorskip("openai", reason="the openai client (the test extra) is not installed")

from conftest import pythonpath, slow_writer  # noqa: E402
from minicpm_cli import protocol  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "tiny-minicpmo"
TEXT = "Hello world. How are you today?"
# about 90,000 characters: over a minute of work for the tiny model, the longest input a request takes
LONG = " ".join(f"Sentence number {i} goes on for a while, and then it stops." for i in range(1400))
KEY = "sekret-key"


def _env(**extra) -> dict:
    """The commands' environment: offline, no server looked for unless `extra` names one, no key."""
    env = {k: v for k, v in os.environ.items() if k not in ("MINICPM_DEBUG", "MINICPM_API_KEY")}
    return {**env, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1", "MINICPM_SERVER": "", **extra}


def minicpm(*args: str, stdin: bytes = b"", env: dict | None = None, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "minicpm_cli", *args], input=stdin, capture_output=True,
                          env=env or _env(), timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A `minicpm serve` process of the tiny checkpoint; its stderr lines collected as they come."""

    def __init__(self, *args: str, port: int = 0, env: dict | None = None, model: Path = TINY):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minicpm_cli", "serve", "--model", str(model), "--device", "cpu",
             "--dtype", "float32", "--port", str(port), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env or _env())
        self.lines: list[str] = []
        self.url: str | None = f"http://127.0.0.1:{port}" if port else None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.decode(errors="replace"))

    def wait_ready(self, timeout: float = 180) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            ready = [line for line in self.lines if line.startswith("minicpm: serving ")]
            if ready:
                self.url = ready[0].split(" at ")[-1].strip()
                return self.url
            if self.proc.poll() is not None:
                time.sleep(0.2)
                raise AssertionError(f"server exited {self.proc.returncode}: {''.join(self.lines)}")
            time.sleep(0.05)
        raise AssertionError(f"server not ready: {''.join(self.lines)}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    @property
    def address(self) -> tuple[str, int]:
        u = urlsplit(self.url)
        return u.hostname, u.port


def call(url: str, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 120):
    """(status, headers, body bytes); `body` a dict (sent as JSON) or bytes."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        data = json.dumps(body) if isinstance(body, dict) else body
        hdrs = {"Content-Type": "application/json", **(headers or {})} if body is not None else dict(headers or {})
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def error_of(status: int, body: bytes, expected: int) -> dict:
    assert status == expected, (status, body[:500])
    error = json.loads(body)["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert "Traceback" not in error["message"] and "\n" not in error["message"], error
    return error


def sse_events(data: bytes) -> list[dict]:
    blocks = [b for b in data.decode().split("\n\n") if b.strip()]
    assert all(b.startswith("data: ") for b in blocks), blocks[:3]
    return [json.loads(b[len("data: "):]) for b in blocks]


def client(url: str, api_key: str = "unused"):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=120)


# -- the tiny model, in-process (`--local`) and through the server -------------------------------------

# (arguments, stdin): each is run with --local and with --server URL; files go to {dir}
CASES = {
    "file": (["say", TEXT, "--greedy", "-o", "{dir}/a.wav"], b""),
    "flac": (["say", TEXT, "--seed", "3", "-o", "{dir}/a.flac"], b""),
    "f32-file": (["say", TEXT, "--greedy", "--pcm", "f32", "-o", "{dir}/a.wav"], b""),
    "stdout": (["say", TEXT, "--greedy", "-o", "-"], b""),
    "first-chunk": (["say", TEXT, "--greedy", "--first-chunk", "8", "-o", "-"], b""),
    "raw-f32-stdin": (["say", "-f", "-", "--greedy", "--raw", "--pcm", "f32"], TEXT.encode()),
    "lines": (["say", "--lines", "--seed", "5", "-o", "-"], b"One line.\nAnd another one.\n"),
    "dir": (["say", "--lines", "--greedy", "--dir", "{dir}"], b"One line.\n\nAnd another one.\n"),
    "reply": (["reply", "Hi there", "--greedy", "-o", "-"], b""),
    "speed-file": (["say", TEXT, "--seed", "4", "--speed", "1.5", "-o", "{dir}/a.wav"], b""),
    "speed-stdout": (["say", TEXT, "--greedy", "--speed", "0.5", "-o", "-"], b""),
    "speed-reply": (["reply", "Hi there", "--greedy", "--speed", "2", "-o", "-"], b""),
}


@dataclass
class Outcome:
    returncode: int
    stdout: bytes
    stderr: str
    files: dict[str, bytes]


def outcome(case: str, where: list[str], tmp: Path, env: dict | None = None) -> Outcome:
    args, stdin = CASES[case]
    d = tmp / f"{case}-{where[0].strip('-')}"
    d.mkdir()
    p = minicpm(*[a.replace("{dir}", str(d)) for a in args], *where, stdin=stdin, env=env)
    return Outcome(p.returncode, p.stdout, p.stderr.decode().replace(str(d), "{dir}"),
                   {f.name: f.read_bytes() for f in sorted(d.iterdir())})


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """What each case writes with the model in-process (`--local`), run once per case."""
    tmp, cache = tmp_path_factory.mktemp("local"), {}

    def get(case: str) -> Outcome:
        if case not in cache:
            cache[case] = outcome(case, ["--local", "--model", str(TINY), "--device", "cpu"], tmp)
            assert cache[case].returncode == 0, cache[case].stderr
        return cache[case]

    return get


@pytest.fixture(scope="module")
def served():
    s = Served()
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_health_models_props(served):
    status, _, body = call(served.url, "GET", "/health")
    assert status == 200 and json.loads(body) == {"status": "ok", "streams": 0}
    status, _, body = call(served.url, "GET", "/v1/models")
    assert status == 200
    models = json.loads(body)
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [str(TINY)]
    assert client(served.url).models.retrieve("tts-1").id == "tts-1"  # (the names a drop-in client sends)
    with pytest.raises(openai.NotFoundError, match="gpt-5"):
        client(served.url).models.retrieve("gpt-5")
    status, _, body = call(served.url, "GET", "/props")
    props = json.loads(body)
    assert (props["backend"], props["device"], props["dtype"], props["sample_rate"]) == ("eager", "cpu", "float32", 24000)
    assert props["path"] == str(TINY.resolve()) and props["voices"] == ["default"]
    assert {"wav", "pcm", "pcm_f32", "flac"} <= set(props["response_formats"])
    assert json.loads(call(served.url, "GET", "/v1/audio/voices")[2]) == {"voices": ["default"]}
    assert served.lines[0].startswith(f"minicpm: serving {TINY} (eager, cpu) at http://127.0.0.1:")
    assert len(served.lines) == 1, served.lines  # one line when ready, nothing else


def test_openai_whole_file_is_say_file(served, local):
    """No stream_format: the whole file `say -o FILE` writes (segment decode), same bytes."""
    c = client(served.url)
    wav = c.audio.speech.create(model="tts-1", voice="default", input=TEXT, response_format="wav",
                                extra_body={"greedy": True}).content
    assert wav == local("file").files["a.wav"]
    audio, sr = sf.read(io.BytesIO(wav), dtype="int16")
    assert sr == 24000 and len(audio) > 0
    flac = c.audio.speech.create(model=str(TINY), voice="default", input=TEXT, response_format="flac",
                                 extra_body={"seed": 3}).content
    assert flac == local("flac").files["a.flac"]
    pcm = c.audio.speech.create(model="tts-1", voice="default", input=TEXT, response_format="pcm",
                                extra_body={"greedy": True}).content
    assert pcm == audio.astype("<i2").tobytes()


def test_openai_speed_is_say_speed(served, local):
    """OpenAI's `speed`: the file and the stream `say --speed` writes in-process, same bytes (same
    seed); the tempo changes the length, by 1/speed within 3%."""
    c = client(served.url)
    wav = c.audio.speech.create(model="tts-1", voice="default", input=TEXT, response_format="wav", speed=1.5,
                                extra_body={"seed": 4}).content
    assert wav == local("speed-file").files["a.wav"]
    with c.audio.speech.with_streaming_response.create(model="tts-1", voice="default", input=TEXT, speed=0.5,
                                                       response_format="wav", stream_format="audio",
                                                       extra_body={"greedy": True}) as r:
        slow = r.read()
    assert slow == local("speed-stdout").stdout
    plain = sf.read(io.BytesIO(local("stdout").stdout))[0]
    assert abs(len(sf.read(io.BytesIO(slow))[0]) / (2 * len(plain)) - 1) < 0.03
    error = error_of(*call(served.url, "POST", "/v1/audio/speech", {"input": "Hi.", "speed": 8})[::2], 400)
    assert error["param"] == "speed" and error["type"] == "invalid_request_error"


def test_openai_stream_is_say_stdout(served, local):
    """stream_format "audio": the bytes `say -o -` streams (a WAV header of unknown length, then the
    chunk-by-chunk decode); the same samples as raw pcm; our first_chunk extension as --first-chunk."""
    c = client(served.url)

    def streamed(**kw) -> tuple[bytes, int]:
        with c.audio.speech.with_streaming_response.create(model="tts-1", voice="default", input=TEXT,
                                                           stream_format="audio", **kw) as r:
            assert r.status_code == 200
            parts = list(r.iter_bytes())
        return b"".join(parts), len(parts)

    wav, _ = streamed(response_format="wav", extra_body={"greedy": True})
    expected = local("stdout").stdout
    assert wav == expected
    ours, sr = sf.read(io.BytesIO(wav), dtype="float32")
    theirs, _ = sf.read(io.BytesIO(expected), dtype="float32")
    assert sr == 24000 and np.array_equal(ours, theirs)
    pcm, _ = streamed(response_format="pcm", extra_body={"greedy": True})
    assert pcm == expected[44:]
    early, _ = streamed(response_format="wav", extra_body={"greedy": True, "first_chunk": 8})
    assert early == local("first-chunk").stdout and early != wav


def test_stream_arrives_while_it_is_generated(served):
    text = " ".join(LONG.split(". ")[:40])
    host, port = served.address
    conn = http.client.HTTPConnection(host, port, timeout=120)
    t0 = time.monotonic()
    conn.request("POST", "/v1/audio/speech", body=json.dumps({"input": text, "greedy": True, "stream_format": "audio",
                                                               "response_format": "pcm"}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.getheader("transfer-encoding") == "chunked"
    first = resp.read1(1 << 16)
    t_first = time.monotonic() - t0
    rest = resp.read()
    total = time.monotonic() - t0
    conn.close()
    assert first and len(first) + len(rest) > 24000 * 2 * 5  # more than 5 s of audio
    assert t_first < total / 3, (t_first, total)


def test_sse_events(served, local):
    c = client(served.url)
    data = c.audio.speech.create(model="tts-1", voice="default", input=TEXT, response_format="wav",
                                 stream_format="sse", extra_body={"greedy": True}).content
    events = sse_events(data)
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1) and len(events) > 3
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == local("stdout").stdout


@pytest.mark.parametrize("case", list(CASES))
def test_cli_through_the_server_writes_what_local_writes(served, local, tmp_path, case):
    """Every output mode of `say` and `reply`: the same bytes, files, stderr and status either way."""
    remote = outcome(case, ["--server", served.url], tmp_path)
    here = local(case)
    assert remote.returncode == 0, remote.stderr
    assert remote.stdout == here.stdout
    assert remote.files == here.files
    assert remote.stderr == here.stderr  # (reply: its text; --dir: the file names)
    assert here.stdout or here.files


def test_the_client_path_imports_no_torch(served, tmp_path):
    out = tmp_path / "x.wav"
    code = ("import os, sys, atexit\n"
            "def check():\n"
            "    bad = [m for m in ('torch', 'minicpm_cli.engine.pipeline', 'minicpm_cli.models') if m in sys.modules]\n"
            "    sys.stderr.write(f'IMPORTED {bad}' if bad else 'CLEAN')\n"
            "    sys.stderr.flush()\n"
            "atexit.register(check)\n"
            "leave = os._exit\n"
            "os._exit = lambda status: (check(), leave(status))  # (without torch the CLI skips the atexit handlers)\n"
            f"sys.argv = ['minicpm', 'say', 'Hi there.', '--model', {str(TINY)!r}, '--greedy', '-o', {str(out)!r}]\n"
            "from minicpm_cli.cli.entry import main\nmain()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, env=_env(MINICPM_SERVER=served.url), timeout=120)
    assert p.returncode == 0 and p.stderr.decode().endswith("CLEAN"), p.stderr.decode()
    assert sf.info(out).frames > 0
    # and with no server, the same command loads the model here
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, env=_env(), timeout=300)
    assert p.returncode == 0 and "IMPORTED" in p.stderr.decode(), p.stderr.decode()


def _one_line_error(p, *needles: str, status: int = 1):
    err = p.stderr.decode()
    lines = [line for line in err.splitlines() if line.strip()]
    assert p.returncode == status and len(lines) == 1 and lines[0].startswith("minicpm: error: "), err
    for n in needles:
        assert n in lines[0], err
    assert p.stdout == b""


def test_what_the_server_cannot_honour_is_an_error(served, tmp_path):
    out = str(tmp_path / "x.wav")
    via = ["--server", served.url]
    _one_line_error(minicpm("say", "Hi.", "--backend", "compile", "-o", out, *via), "serves backend eager, not compile", "--local")
    _one_line_error(minicpm("say", "Hi.", "--model", "openbmb/MiniCPM-o-2_6", "-o", out, *via), "serves model")
    _one_line_error(minicpm("reply", "Hi.", "--dtype", "bfloat16", "-o", out, *via), "dtype float32, not bfloat16")
    _one_line_error(minicpm("say", "Hi.", "--gguf", "x.gguf", "--backend", "gguf", "-o", out, *via), "GGUF")
    _one_line_error(minicpm("say", "x" * (protocol.MAX_INPUT_CHARS + 1), "-o", out, *via), "--local", "100000")
    _one_line_error(minicpm("say", "Hi.", "-o", out, "--server", f"http://127.0.0.1:{free_port()}"), "no server answers")
    _one_line_error(minicpm("say", "Hi.", "-o", out, "--local", *via), "--local and --server", status=2)
    # a relative path to the served checkpoint is the same model; MINICPM_SERVER finds the server
    p = subprocess.run([sys.executable, "-m", "minicpm_cli", "say", "Hi.", "--model", "tests/fixtures/tiny-minicpmo",
                        "--device", "cpu", "--dtype", "fp32", "-v", "-o", out],
                       capture_output=True, env=_env(MINICPM_SERVER=served.url + "/v1"), cwd=ROOT, timeout=120)
    assert p.returncode == 0 and p.stderr.decode() == f"minicpm: server {served.url}: backend eager, device cpu, model {TINY}\n"
    assert [f.name for f in tmp_path.iterdir()] == ["x.wav"]


def test_eight_concurrent_requests_each_get_their_own(served):
    texts = [f"Request number {i} asks for its own words, {'and more ' * i}please." for i in range(4)]
    jobs = [(t, mode) for t in texts for mode in ("file", "stream")]

    def ask(text: str, mode: str) -> bytes:
        body = {"input": text, "greedy": True, "response_format": "wav"}
        if mode == "stream":
            body["stream_format"] = "audio"
        status, _, data = call(served.url, "POST", "/v1/audio/speech", body)
        assert status == 200
        return data

    alone = {job: ask(*job) for job in jobs}
    results: dict = {}
    barrier = threading.Barrier(len(jobs))

    def worker(job):
        barrier.wait()
        results[job] = ask(*job)

    threads = [threading.Thread(target=worker, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == alone
    assert len(set(alone.values())) == len(jobs)


def test_a_seeded_request_gives_the_same_bytes_among_eight_others(served):
    """The same seeded request alone and while eight others (their own texts and seeds, streamed
    and not) run beside it in the server's batch: the same bytes (float32 on the CPU; bfloat16 on a
    GPU is tests/test_invariant.py's)."""
    target = {"input": "The same seed gives the same audio, whatever else runs.", "seed": 11, "response_format": "wav"}

    def ask(body: dict) -> bytes:
        status, _, data = call(served.url, "POST", "/v1/audio/speech", body)
        assert status == 200
        return data

    alone = ask(target)
    others = [{"input": f"Another request, number {i}, {'with more words ' * (i % 3)}beside it.", "seed": i,
               "response_format": "wav", **({"stream_format": "audio"} if i % 2 else {})} for i in range(8)]
    results: dict = {}
    barrier = threading.Barrier(len(others) + 1)

    def worker(k, body):
        barrier.wait()
        if k is None:
            time.sleep(0.2)  # (joins the others' batch mid-flight)
        results[k] = ask(body)

    threads = [threading.Thread(target=worker, args=(k, b)) for k, b in [(None, target), *enumerate(others)]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 9 and results[None] == alone


def test_a_client_that_leaves_stops_its_generation(served):
    """LONG takes over a minute on the tiny model; once its client is gone the next request runs at
    once (well within 30 s, on a loaded machine too), whether the long one was streaming or building a
    whole file. Health answers meanwhile."""
    host, port = served.address
    assert len(LONG) <= protocol.MAX_INPUT_CHARS
    for stream in (True, False):
        conn = http.client.HTTPConnection(host, port, timeout=120)
        body = {"input": LONG, "greedy": True, "response_format": "pcm", **({"stream_format": "audio"} if stream else {})}
        conn.request("POST", "/v1/audio/speech", body=json.dumps(body), headers={"Content-Type": "application/json"})
        if stream:
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read1(1 << 16)
        else:
            time.sleep(1.0)  # generating the whole file
        assert call(served.url, "GET", "/health", timeout=15)[0] == 200  # (not after the long request)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        # (a socket timeout here means the short request waited for the abandoned one)
        assert call(served.url, "POST", "/v1/audio/speech", {"input": "Hello.", "greedy": True}, timeout=30)[0] == 200


BAD = [
    # (path, body, status, words in the message)
    ("/v1/audio/speech", {"input": "Hi.", "voice": "nobody"}, 400, ["nobody", "voices: default;", "OpenAI"]),
    ("/v1/audio/speech", {"input": "Hi.", "voice": {"id": "voice_1234"}}, 400, ["voice_1234"]),
    ("/v1/audio/speech", {"input": "Hi.", "voice": "../../etc/passwd"}, 400, ["unknown voice"]),
    ("/v1/audio/speech", {"input": "Hi.", "voice_samples": "not base64!"}, 400, ["voice_samples", "base64"]),
    ("/v1/audio/speech", {"input": "Hi.", "voice_samples": "AAAA"}, 400, ["float32"]),
    ("/v1/audio/speech", {"input": "Hi.", "voice_samples": base64.b64encode(bytes(64000)).decode()}, 400, ["silent"]),
    ("/v1/audio/speech", {"input": "Hi.", "voice": "echo", "voice_samples": "AAAAAA=="}, 400, ["not both"]),
    ("/v1/audio/reply", {"input": "Hi.", "voice_samples": base64.b64encode(bytes(4000)).decode()}, 400,
     ["0.06 s of audio", "at least 0.5 s"]),
    # (a model without the audio encoder: a voice is a request it cannot serve, not a failure)
    ("/v1/audio/speech", {"input": "Hi.", "voice_samples": base64.b64encode(
        (0.5 * np.sin(np.arange(16000) / 5)).astype("<f4").tobytes()).decode()}, 400, ["no audio encoder"]),
    ("/v1/audio/speech", {"input": "Hi.", "response_format": "aac"}, 400, ["aac"]),
    ("/v1/audio/speech", {"input": "Hi.", "speed": 4.5}, 400, ["speed must be between 0.25 and 4"]),
    ("/v1/audio/speech", {"input": "Hi.", "speed": 0.2}, 400, ["speed"]),
    ("/v1/audio/reply", {"input": "Hi.", "speed": 0}, 400, ["speed"]),
    ("/v1/audio/speech", {"input": "Hi.", "instructions": "Whisper."}, 400, ["instructions"]),
    ("/v1/audio/speech", {"input": "Hi.", "stream_format": "video"}, 400, ["stream_format"]),
    ("/v1/audio/speech", {"input": "Hi.", "stream_format": "audio", "response_format": "flac"}, 400, ["whole file"]),
    ("/v1/audio/speech", {"input": "Hi.", "greedy": True, "seed": 1}, 400, ["greedy takes no seed"]),
    ("/v1/audio/speech", {"input": "Hi.", "seed": 2**64}, 400, ["seed"]),
    ("/v1/audio/speech", {"input": "Hi.", "first_chunk": 0}, 400, ["first_chunk"]),
    ("/v1/audio/speech", {"input": "  \n "}, 400, ["no text to speak"]),
    ("/v1/audio/speech", {"input": "Hi.", "model": "gpt-5"}, 404, ["gpt-5"]),
    ("/v1/audio/speech", {"input": "x" * (protocol.MAX_INPUT_CHARS + 1)}, 413, ["characters"]),
    ("/v1/audio/speech", {"voice": "default"}, 422, ["input"]),
    ("/v1/audio/speech", {"input": 5}, 422, ["input"]),
    ("/v1/audio/speech", {"input": "Hi.", "greedy": "yes"}, 422, ["greedy"]),
    ("/v1/audio/speech", b"{not json", 422, ["JSON"]),
    ("/v1/audio/speech", b"[1, 2]", 422, []),
    ("/v1/audio/reply", {"input": "Hi.", "temperature": 0}, 400, ["temperature"]),
    ("/v1/audio/reply", {"input": "Hi.", "max_tokens": 0}, 400, ["max_tokens"]),
    ("/v1/audio/reply", {"input": "Hi.", "response_format": "flac"}, 400, ["response_format"]),
    ("/v1/audio/reply", {"input": "Hi.", "stream_format": "audio"}, 400, ["sse"]),
    ("/v1/audio/reply", {"input": ""}, 400, ["no text to reply to"]),
    ("/v1/audio/speech", {"input": "Caf\udce9 au lait"}, 400, ["not UTF-8: byte 0xE9 at character 4"]),
    ("/v1/audio/reply", {"input": "a\ud800b"}, 400, ["unpaired surrogate, U+D800, at character 2"]),
]


def test_bad_requests_get_their_status_and_the_server_stays_up(served):
    for path, body, status, words in BAD:
        got, headers, data = call(served.url, "POST", path, body)
        error = error_of(got, data, status)
        assert headers.get("content-type") == "application/json", (body, headers)
        for w in words:
            assert w in error["message"], (body, error)
    error_of(*call(served.url, "GET", "/nope")[::2], 404)
    error_of(*call(served.url, "GET", "/v1/audio/speech")[::2], 405)
    # a body over the limit: refused on its Content-Length, or once it passes the limit (chunked)
    host, port = served.address
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.putrequest("POST", "/v1/audio/speech")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(protocol.MAX_VOICE_BODY_BYTES + 1))
    conn.endheaders()
    resp = conn.getresponse()
    error_of(resp.status, resp.read(), 413)
    conn.close()
    conn = http.client.HTTPConnection(host, port, timeout=30)
    pad = b" " * (64 << 10)
    conn.request("POST", "/v1/audio/speech", body=iter([pad] * (protocol.MAX_VOICE_BODY_BYTES // len(pad) + 1)),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    error_of(resp.status, resp.read(), 413)
    conn.close()
    # a body over the limit apart from voice_samples (which raise the limit for themselves)
    status, _, data = call(served.url, "POST", "/v1/audio/speech",
                           {"input": "Hi.", "pad": "x" * protocol.MAX_BODY_BYTES})
    assert "voice_samples apart" in error_of(status, data, 413)["message"]
    # the official client sees the same errors
    with pytest.raises(openai.BadRequestError) as e:
        client(served.url).audio.speech.create(model="tts-1", voice="nobody", input="Hi.")
    assert e.value.status_code == 400 and "default" in str(e.value)
    # mp3 and opus: where this libsndfile writes them, else a 400 that says so
    formats = json.loads(call(served.url, "GET", "/props")[2])["response_formats"]
    for fmt, magic in (("mp3", (b"ID3", b"\xff\xfb", b"\xff\xf3")), ("opus", (b"OggS",))):
        got, _, data = call(served.url, "POST", "/v1/audio/speech", {"input": "Hi.", "response_format": fmt})
        if fmt in formats:
            assert got == 200 and data.startswith(magic), (fmt, data[:8])
        else:
            assert "libsndfile" in error_of(got, data, 400)["message"]
    assert call(served.url, "GET", "/health")[0] == 200
    assert call(served.url, "POST", "/v1/audio/speech", {"input": "Still here.", "greedy": True})[0] == 200


def test_reply_endpoint_streams_text_and_audio(served, local):
    got, headers, data = call(served.url, "POST", "/v1/audio/reply", {"input": "Hi there", "greedy": True})
    assert got == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(data)
    kinds = {e["type"] for e in events}
    assert kinds == {"reply.audio.delta", "reply.text.delta", "reply.done"} and events[-1]["type"] == "reply.done"
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "reply.audio.delta")
    text = "".join(e["text"] for e in events if e["type"] == "reply.text.delta")
    here = local("reply")
    assert audio == here.stdout
    assert text + "\n" == here.stderr and events[-1]["text"] == text
    from minicpm_cli.engine.text import Tokenizers

    # usage: the reply's LLM tokens, and apart from them the audio frames (512 samples each)
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == len(Tokenizers(TINY).encode_llm(text)) > 0
    assert (len(audio) - 44) // 2 == 512 * usage["audio_frames"], (len(audio), usage)


# -- the speech socket: text in as it arrives, audio out ------------------------------------------------


@dataclass
class Heard:
    audio: bytes  # the binary messages, joined
    events: list[dict]  # the JSON messages
    code: int | None  # the close code
    subprotocol: str | None = None

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]


def socket_url(url: str) -> str:
    return url.replace("http://", "ws://") + protocol.SPEECH_STREAM_PATH


def connect(url: str, **kw):
    from websockets.sync.client import connect as ws_connect

    return ws_connect(socket_url(url), max_size=None, open_timeout=30, **kw)


def hear(ws, until=None, timeout: float = 120) -> Heard:
    """Read the socket to its close (or to the first event `until(event)` holds)."""
    from websockets.exceptions import ConnectionClosed

    heard = Heard(b"", [], None, ws.subprotocol)
    try:
        while True:
            message = ws.recv(timeout=timeout)
            if isinstance(message, bytes):
                heard.audio += message
                continue
            heard.events.append(json.loads(message))
            if until is not None and until(heard.events[-1]):
                return heard
    except ConnectionClosed:
        heard.code = ws.close_code
    return heard


def over_socket(url: str, messages: list, **kw) -> Heard:
    """`messages` (dicts sent as JSON, str and bytes as they are) on the speech socket, then all it says."""
    from websockets.exceptions import ConnectionClosed

    with connect(url, **kw) as ws:
        try:
            for m in messages:
                ws.send(m if isinstance(m, (str, bytes)) else json.dumps(m))
        except ConnectionClosed:
            pass  # (refused early: what it said is read below)
        return hear(ws)


def health_streams(url: str) -> int:
    status, _, body = call(url, "GET", "/health", timeout=15)
    assert status == 200
    return json.loads(body)["streams"]


@pytest.fixture(scope="module")
def synth():
    """The tiny model in this process, as `say --local` loads it."""
    from minicpm_cli.engine.pipeline import Synthesizer

    return Synthesizer.load(str(TINY), device="cpu", dtype="float32")


def test_socket_text_given_whole_is_the_speech_endpoints(served, local):
    """Start, then the text with the end: what `say -o -` writes (a WAV header, then the streamed
    decode), and, with stream_format null, the samples of `say -o FILE`; one segment's events."""
    heard = over_socket(served.url, [{"type": "start", "greedy": True}, {"type": "end", "text": TEXT}])
    assert heard.code == 1000 and heard.audio == local("stdout").stdout
    samples = (len(heard.audio) - 44) // 2
    assert [e["type"] for e in heard.events] == ["speech.segment.started", "speech.segment.done", "speech.audio.done"]
    assert heard.events[0] == {"type": "speech.segment.started", "segment": 0, "start": 0.0, "start_sample": 0}
    done = heard.events[1]
    assert (done["segment"], done["text"], done["start_sample"], done["end_sample"]) == (0, TEXT, 0, samples)
    assert done["end"] == round(samples / 24000, 6)
    usage = heard.events[2]["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] * 512 == samples
    whole = over_socket(served.url, [{"type": "start", "greedy": True, "response_format": "pcm", "stream_format": None},
                                     {"type": "end", "text": TEXT}])
    file_samples = sf.read(io.BytesIO(local("file").files["a.wav"]), dtype="int16")[0]
    assert whole.code == 1000 and whole.audio == file_samples.astype("<i2").tobytes()


SPLIT = [("The first sentence ", False), ("is here. And then", False), (" a second one follows it.", True)]


def test_socket_parts_are_the_in_process_parts(served, synth):
    """Each message is one arrival: the parts, segments, samples and caption cues are those
    `synthesize_arriving` makes in-process of the same arrivals."""
    from minicpm_cli.captions import cues
    from minicpm_cli.engine.sampling import Sampling

    messages = [{"type": "end" if ended else "text", "text": t} for t, ended in SPLIT]
    heard = over_socket(served.url, [{"type": "start", "greedy": True, "response_format": "pcm_f32",
                                      "timestamps": True}, *messages])
    chunks = list(synth.synthesize_arriving(SPLIT, Sampling(greedy=True)))
    assert heard.code == 1000
    assert heard.audio == np.concatenate([c.samples for c in chunks]).astype("<f4").tobytes()
    assert heard.of("speech.caption") == [{"type": "speech.caption", **c.timestamp(24000)} for c in cues(chunks)]
    done = heard.of("speech.segment.done")
    assert [(d["segment"], d["text"]) for d in done] == [(0, "The first sentence is here."),
                                                         (1, "And then a second one follows it.")]
    assert done[0]["end_sample"] == done[1]["start_sample"] == sum(len(c.samples) for c in chunks if c.segment == 0)
    assert done[1]["end_sample"] * 4 == len(heard.audio)


def test_socket_flush_speaks_what_is_pending_at_once(served, synth):
    """A flush makes the pending text a part even without a sentence end: its segment is spoken, and
    all of its audio (the crossfade's tail too) comes before any more text is sent."""
    from minicpm_cli.engine.sampling import Sampling
    from minicpm_cli.engine.text import Arrival

    with connect(served.url) as ws:
        ws.send(json.dumps({"type": "start", "greedy": True, "response_format": "pcm_f32"}))
        ws.send(json.dumps({"type": "text", "text": "Hello there"}))
        ws.send(json.dumps({"type": "flush"}))
        first = hear(ws, until=lambda e: e["type"] == "speech.segment.done")
        ws.send(json.dumps({"type": "end", "text": " And the rest comes later."}))
        rest = hear(ws)
    arrivals = [Arrival("Hello there"), Arrival("", flush=True), Arrival(" And the rest comes later.", ended=True)]
    chunks = list(synth.synthesize_arriving(arrivals, Sampling(greedy=True)))
    expected = [np.concatenate([c.samples for c in chunks if c.segment == k]).astype("<f4").tobytes() for k in (0, 1)]
    assert first.audio == expected[0] and first.events[-1]["text"] == "Hello there"
    assert rest.code == 1000 and rest.audio == expected[1]


def test_socket_waits_parked_and_leaving_frees_its_stream(served):
    """A session waiting for text holds its stream without holding the model: another request is
    served meanwhile, and the server sleeps (no CPU spent) while nothing but it is left. Closing the
    socket ends its stream, waiting or generating (LONG would take minutes): /health counts none."""
    def cpu_seconds() -> float:
        fields = Path(f"/proc/{served.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    with connect(served.url) as waiting, connect(served.url) as generating:
        waiting.send(json.dumps({"type": "start", "greedy": True}))
        waiting.send(json.dumps({"type": "text", "text": "Still thinking about what to say"}))  # (not a part yet)
        end = time.monotonic() + 30
        while health_streams(served.url) != 1 and time.monotonic() < end:
            time.sleep(0.05)
        assert call(served.url, "POST", "/v1/audio/speech", {"input": "Hello.", "greedy": True}, timeout=60)[0] == 200
        time.sleep(0.3)
        before = cpu_seconds()
        time.sleep(2.0)
        # (an engine spinning over its parked stream spent 0.6 s a second, on the loaded 2-core machine)
        assert cpu_seconds() - before < 0.3
        assert health_streams(served.url) == 1
        generating.send(json.dumps({"type": "start", "greedy": True, "response_format": "pcm"}))
        generating.send(json.dumps({"type": "end", "text": LONG[:20000]}))
        while not isinstance(generating.recv(timeout=60), bytes):
            pass
        assert health_streams(served.url) == 2
    end = time.monotonic() + 30
    while health_streams(served.url) and time.monotonic() < end:
        time.sleep(0.05)
    assert health_streams(served.url) == 0


SOCKET_BAD = [
    # (messages, close code, words in the error's message)
    ([{"type": "start", "response_format": "aac"}], 4400, ["aac"]),
    ([{"type": "start", "response_format": "flac"}], 4400, ["whole file"]),
    ([{"type": "start", "stream_format": "sse"}], 4400, ["stream_format"]),
    ([{"type": "start", "greedy": True, "seed": 1}], 4400, ["greedy takes no seed"]),
    ([{"type": "start", "speed": 8}], 4400, ["speed must be between 0.25 and 4"]),
    ([{"type": "start", "voice": "nobody"}], 4400, ["nobody"]),
    ([{"type": "start", "model": "gpt-5"}], 4404, ["gpt-5"]),
    ([{"type": "start", "input": "Hi."}], 4422, ["input"]),
    ([{"type": "start", "greedy": "yes"}], 4422, ["greedy"]),
    ([{"type": "text", "text": "Hi."}], 4422, ["type"]),
    (["{not json"], 4422, ["JSON"]),
    ([b"\x00\x01"], 4400, ["JSON text"]),
    ([{"type": "start"}, {"type": "speak", "text": "Hi."}], 4422, ["type"]),
    ([{"type": "start"}, {"type": "end", "text": "  "}], 4400, ["no text to speak"]),
    # (JSON's "\ud800", which pydantic's parser calls not JSON: said as the speech endpoint says it)
    ([{"type": "start"}, {"type": "end", "text": "Hi \ud800 there."}], 4400,
     ["the text is not Unicode text: an unpaired surrogate, U+D800, at character 4"]),
    ([{"type": "start", "greedy": True}, {"type": "end", "text": "Hi."}, {"type": "text", "text": "More."}], 4400,
     ["ended"]),
]


def test_socket_bad_messages_get_an_error_then_a_close(served):
    said = len(served.lines)
    for messages, code, words in SOCKET_BAD:
        heard = over_socket(served.url, messages)
        assert heard.code == code, (messages, heard)
        error = heard.events[-1]
        assert error["type"] == "error", (messages, heard.events)
        error = error["error"]
        assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"], error
        for w in words:
            assert w in error["message"], (messages, error)
    assert not [line for line in served.lines[said:] if "Traceback" in line or "error" in line.lower()], served.lines
    assert over_socket(served.url, [{"type": "start"}, {"type": "end", "text": "Still here."}]).code == 1000


def test_socket_waiting_for_text_too_long_is_closed_4408():
    """`serve --socket-idle S`: a socket whose stream has waited S seconds for text (no start message,
    or text that is not yet a part) gets idle_timeout and 4408, and frees its row. Each message starts
    the wait anew, and it counts only while the stream has nothing to speak: not while it generates,
    nor once the text has ended."""
    limit = 1.5
    s = Served("--socket-idle", str(limit))
    try:
        s.wait_ready()
        with connect(s.url) as silent, connect(s.url) as waiting:
            t0 = time.monotonic()
            waiting.send(json.dumps({"type": "start", "greedy": True}))
            waiting.send(json.dumps({"type": "text", "text": "Waiting for the rest"}))  # (not a part yet)
            for ws in (silent, waiting):
                heard = hear(ws, timeout=60)
                assert heard.code == 4408 and heard.of("error")[0]["error"]["code"] == "idle_timeout", heard
            assert limit <= time.monotonic() - t0 < limit + 15
        with connect(s.url) as chatty:  # a message each 0.5 s for twice the limit, then the end: spoken whole
            chatty.send(json.dumps({"type": "start", "greedy": True, "response_format": "pcm"}))
            for word in ["Every", " word", " comes", " a", " little", " later"]:
                chatty.send(json.dumps({"type": "text", "text": word}))
                time.sleep(0.5)
            chatty.send(json.dumps({"type": "end", "text": "."}))
            heard = hear(chatty)
            assert heard.code == 1000 and heard.audio and heard.of("speech.audio.done"), heard.events
        text = " ".join(LONG.split(". ")[:40]) + "."
        with connect(s.url) as busy:  # generating longer than the limit, then waiting: closed after the limit
            busy.send(json.dumps({"type": "start", "greedy": True, "response_format": "pcm"}))
            t0 = time.monotonic()
            busy.send(json.dumps({"type": "flush", "text": text}))
            heard = hear(busy, until=lambda e: e["type"] == "speech.segment.done" and e["text"].endswith("stops."))
            last_audio = time.monotonic()  # (the segment's done event follows its last audio)
            rest = hear(busy, timeout=60)
            closed = time.monotonic()
            heard.events += rest.events
            assert rest.code == 4408
            spoken = heard.of("speech.segment.done")
            assert " ".join(d["text"] for d in spoken).split() == text.split(), heard.events[-3:]
            assert heard.events[-1]["type"] == "error" and heard.events[-1]["error"]["code"] == "idle_timeout"
            assert last_audio - t0 > limit and closed - last_audio >= limit - 0.2, (t0, last_audio, closed)
        with connect(s.url) as ended:  # the text has ended: no limit while it is spoken
            ended.send(json.dumps({"type": "start", "greedy": True, "response_format": "pcm"}))
            ended.send(json.dumps({"type": "end", "text": text}))
            assert hear(ended, timeout=120).code == 1000
        # `say` reading a pipe whose writer pauses longer than the limit keeps its stream (empty messages)
        code, err, came, out = slow_writer([sys.executable, "-m", "minicpm_cli", "say", "--server", s.url, "--greedy",
                                            "-o", "-"], _env(), pause=3 * limit)
        assert code == 0 and err == b"" and came and len(out) > 44, err
        end = time.monotonic() + 30
        while health_streams(s.url) and time.monotonic() < end:
            time.sleep(0.05)
        assert health_streams(s.url) == 0
        assert not [line for line in s.lines if "Traceback" in line or "error" in line.lower()], s.lines
    finally:
        s.stop()


def test_say_through_the_server_speaks_before_a_slow_writer_goes_on(served):
    """`say --server` reading a pipe: the first sentence, then the writer waits: the first audio byte
    comes while it waits (the rest is written once audio came, or after 120 s)."""
    code, err, came, out = slow_writer([sys.executable, "-m", "minicpm_cli", "say", "--server", served.url, "--greedy",
                                        "-o", "-"], _env())
    assert code == 0 and err == b""
    assert came, "no audio before the rest of the text was written"
    assert out[:4] == b"RIFF" and len(out) > 44


def test_bench_measures_the_server(served, tmp_path):
    out = tmp_path / "bench.json"
    p = minicpm("bench", "--server", served.url, "--runs", "1", "--warmup", "0", "--max-tokens", "24",
                "--json", str(out))
    assert p.returncode == 0, p.stderr.decode()
    table = p.stdout.decode()
    assert "| eager (server) | read |" in table and "| eager (server) | reply |" in table
    assert f"measured over HTTP at {served.url}" in table and "Forced lengths" not in table
    result = json.loads(out.read_text())
    assert result["environment"]["server"] == served.url and result["environment"]["torch"]
    for e in result["results"]:
        assert e["load_s"] is None and e["llm_ms_per_token"] is None
        assert len(e["samples"]) == (3 if e["workload"] == "read" else 6)
        for s in e["samples"]:
            assert 0 < s["ttfa_ms"] <= s["total_s"] * 1e3 and s["audio_s"] > 0 and s["rtf"] > 0
    p = minicpm("bench", "--server", served.url, "--backend", "eager")
    assert p.returncode == 2 and "--backend" in p.stderr.decode()


# -- a server with an API key: loading, the key, SIGTERM ---------------------------------------------


@pytest.fixture(scope="module")
def secured():
    """Started on a port known in advance, so that /health can be watched while the model loads."""
    s = Served("--api-key", KEY, port=free_port())
    statuses, first_503 = [], None
    end = time.monotonic() + 180
    while time.monotonic() < end and s.proc.poll() is None:
        try:
            status, _, body = call(s.url, "GET", "/health", timeout=5)
        except OSError:  # not listening yet (imports)
            time.sleep(0.05)
            continue
        statuses.append(status)
        if status == 503 and first_503 is None:
            models = call(s.url, "GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            first_503 = (body, models[0])
        if status == 200:
            break
        time.sleep(0.05)
    s.loading = (statuses, first_503)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_health_is_503_while_loading(secured):
    statuses, (body, models) = secured.loading
    assert statuses[0] == 503 and statuses[-1] == 200 and set(statuses) == {503, 200}, statuses
    assert error_of(503, body, 503)["code"] == "model_loading"
    assert models in (503, 200)  # (/v1/models answers 503 too, unless the loading ended in between)


def test_api_key(secured, local, tmp_path):
    url = secured.url
    for path in ("/v1/models", "/props", "/v1/audio/voices", "/v1/voices"):
        error_of(*call(url, "GET", path)[::2], 401)
        error_of(*call(url, "GET", path, headers={"Authorization": "Bearer nope"})[::2], 401)
        assert call(url, "GET", path, headers={"Authorization": f"Bearer {KEY}"})[0] == 200
    error_of(*call(url, "POST", "/v1/audio/speech", {"input": "Hi."})[::2], 401)
    assert upload(url, {"name": "k"}, ("k.wav", REF.read_bytes()))[0] == 401
    assert call(url, "GET", "/health")[0] == 200  # (probes carry no key)
    with pytest.raises(openai.AuthenticationError):
        client(url).audio.speech.create(model="tts-1", voice="default", input="Hi.")
    wav = client(url, KEY).audio.speech.create(model="tts-1", voice="default", input=TEXT, response_format="wav",
                                               extra_body={"greedy": True}).content
    assert wav == local("file").files["a.wav"]
    keyed = outcome("stdout", ["--server", url], tmp_path, env=_env(MINICPM_API_KEY=KEY))
    assert keyed.returncode == 0 and keyed.stdout == local("stdout").stdout
    _one_line_error(minicpm("say", "Hi.", "-o", "-", "--server", url), "MINICPM_API_KEY")


def test_socket_api_key(secured):
    """The socket takes the key as the HTTP API does, or as a subprotocol (a browser's way); without
    it: the error, then a close with 4401."""
    for kw in ({}, {"additional_headers": {"Authorization": "Bearer nope"}}, {"subprotocols": ["minicpm.key.nope"]}):
        heard = over_socket(secured.url, [{"type": "start"}, {"type": "end", "text": "Hi."}], **kw)
        assert heard.code == 4401 and heard.of("error")[0]["error"]["code"] == "invalid_api_key", (kw, heard)
    # (past the key, a start that cannot be served is the next error)
    heard = over_socket(secured.url, [{"type": "start", "response_format": "aac"}],
                        additional_headers={"Authorization": f"Bearer {KEY}"})
    assert heard.code == 4400, heard
    heard = over_socket(secured.url, [{"type": "start", "greedy": True}, {"type": "end", "text": "Hi."}],
                        subprotocols=["minicpm", f"minicpm.key.{KEY}"])
    assert heard.code == 1000 and len(heard.audio) > 44 and heard.subprotocol == "minicpm", heard.events


def test_sigterm_lets_the_request_in_flight_finish(secured):
    """The HTTP request in flight and a speech socket whose input has ended finish their audio; a socket
    still waiting for text is told the server is shutting down (503, then 4503; uvicorn alone would
    close every socket at once with 1012), one still waiting for its start message too (it got that
    1012); the server exits 0."""
    text = " ".join(LONG.split(". ")[:50])
    host, port = secured.address
    auth = {"Authorization": f"Bearer {KEY}"}
    with connect(secured.url, additional_headers=auth) as waiting, \
            connect(secured.url, additional_headers=auth) as ended, \
            connect(secured.url, additional_headers=auth) as silent:
        waiting.send(json.dumps({"type": "start"}))
        waiting.send(json.dumps({"type": "text", "text": "Waiting for the rest"}))
        ended.send(json.dumps({"type": "start", "greedy": True, "response_format": "pcm"}))
        ended.send(json.dumps({"type": "end", "text": text}))
        conn = http.client.HTTPConnection(host, port, timeout=120)
        body = {"input": text, "greedy": True, "stream_format": "audio", "response_format": "pcm"}
        conn.request("POST", "/v1/audio/speech", body=json.dumps(body), headers={"Content-Type": "application/json", **auth})
        resp = conn.getresponse()
        first = resp.read1(1 << 16)
        started = hear(ended, until=lambda e: e["type"] == "speech.segment.started")
        # (read on as the server sends: a client that stops reading stops answering the server's pings,
        # and uvicorn drops it after 20 + 20 s, which under load cut this socket before it was read)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            heard = pool.submit(hear, ended, timeout=120)
            told = pool.submit(hear, waiting, timeout=60)
            unstarted = pool.submit(hear, silent, timeout=60)
            secured.proc.send_signal(signal.SIGTERM)
            rest = resp.read()  # (IncompleteRead if the response were cut)
            conn.close()
            heard, told, unstarted = heard.result(), told.result(), unstarted.result()
        assert len(first) + len(rest) > 24000 * 2 * 5
        for t in (told, unstarted):
            assert t.code == 4503 and t.of("error")[0]["error"]["code"] == "shutting_down", t
        assert heard.code == 1000 and heard.of("speech.audio.done"), heard.events[-3:]
        done = heard.of("speech.segment.done")
        assert " ".join(d["text"] for d in done).split() == text.split()
    assert secured.proc.wait(timeout=60) == 0, secured.lines
    assert not [line for line in secured.lines if "Traceback" in line or "error" in line.lower()], secured.lines
    assert any("in flight to finish" in line for line in secured.lines), secured.lines
    with pytest.raises(OSError):
        call(secured.url, "GET", "/health", timeout=5)


def test_ctrl_c_while_the_model_loads_is_interrupted_130():
    """Ctrl-C before the server is ready (while it imports, and while /health says it loads): one
    line and 130 (it exited 0, or aborted with SIGABRT, the loading thread inside torch at the
    interpreter's exit)."""
    for when in ("importing", "loading"):
        s = Served(port=free_port())
        try:
            if when == "importing":
                time.sleep(0.3)
            else:
                end = time.monotonic() + 120
                while time.monotonic() < end:
                    try:
                        if call(s.url, "GET", "/health", timeout=5)[0] == 503:
                            break
                    except OSError:  # (not listening yet)
                        time.sleep(0.02)
                else:
                    raise AssertionError(s.lines)
            s.proc.send_signal(signal.SIGINT)
            assert s.proc.wait(timeout=60) == 130, (when, s.lines)
            time.sleep(0.2)  # (the reader thread's last lines)
            assert [line.strip() for line in s.lines if line.strip()] == ["minicpm: interrupted"], (when, s.lines)
        finally:
            s.stop()


def test_a_second_ctrl_c_cuts_the_requests_in_flight_in_one_line():
    """The first Ctrl-C says what the server waits for; a second cuts it: one line, status 130, no
    traceback (uvicorn logged the cut request's CancelledError as one, and the server exited 0)."""
    s = Served(port=free_port())
    try:
        s.wait_ready()
        host, port = s.address
        conn = http.client.HTTPConnection(host, port, timeout=120)
        body = {"input": LONG[:20000], "stream_format": "audio", "response_format": "pcm"}
        conn.request("POST", "/v1/audio/speech", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.read1(1 << 16)
        s.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(timeout=60) == 130, s.lines
        with pytest.raises((http.client.IncompleteRead, OSError)):
            resp.read()
        conn.close()
        time.sleep(0.2)
        lines = [line.strip() for line in s.lines if line.strip()][1:]  # (after the ready line)
        assert lines == ["minicpm: stopping: 1 request in flight to finish (Ctrl-C again cuts it)",
                         "minicpm: interrupted: the requests in flight are cut"], s.lines
    finally:
        s.stop()


def test_serve_usage_errors():
    """An open host without a key, a bad port, a taken port, a model that does not load: one line."""
    p = minicpm("serve", "--host", "0.0.0.0", "--model", str(TINY))
    _one_line_error(p, "--api-key", "--insecure", status=2)
    _one_line_error(minicpm("serve", "--port", "70000"), "--port", status=2)
    for idle in ("-1", "nan", "inf"):
        _one_line_error(minicpm("serve", "--socket-idle", idle), "--socket-idle", status=2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        _one_line_error(minicpm("serve", "--port", str(taken.getsockname()[1])), "cannot listen", "in use")
    _one_line_error(minicpm("serve", "--port", "0", "--model", "/no/such/model"), "model directory not found")


def test_serve_help_does_not_import_torch():
    code = ("import sys\nsys.argv = ['minicpm', 'serve', '--help']\nfrom minicpm_cli.cli.app import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\nassert 'torch' not in sys.modules\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, env=_env())
    assert p.returncode == 0 and b"--api-key" in p.stdout, p.stderr.decode()


def test_protocol_frames_per_call_is_the_tts_one():
    from minicpm_cli.engine.tts import FRAMES_PER_CALL

    assert protocol.FRAMES_PER_CALL == FRAMES_PER_CALL


# -- the application in-process, over a fake model ---------------------------------------------------


@dataclass
class FakeChunk:
    samples: np.ndarray
    codes: np.ndarray
    text: str = ""


class FakeSynth:
    """Chunks whose samples say which request and which chunk they are. Text: 'NAME n=N delay=S
    fail=K' (fail: raise before chunk K). One stream at a time (no `rows`: the server runs no batch)."""

    sample_rate = 24000
    tokenizers = SimpleNamespace(encode_bert=lambda text: text.split(), encode_llm=lambda text: text.split())

    def __init__(self):
        self.started: list[str] = []
        self.produced: dict[str, int] = {}
        self.forced: dict[str, int | None] = {}
        self.max_tokens: dict[str, int] = {}
        self.voices: dict[str, object] = {}  # the voice each request was given

    def synthesize(self, text, sampling, *, decode, first_chunk, frames_per_token=None, voice=None, lane=None,
                   speed=1.0):
        name, *opts = text.split()
        o = dict(x.split("=") for x in opts)
        n, delay, fail = int(o.get("n", 3)), float(o.get("delay", 0)), int(o.get("fail", -1))
        self.started.append(name)
        self.produced[name] = 0
        self.forced[name] = frames_per_token
        self.voices[name] = voice
        for i in range(n):
            if i == fail:
                raise RuntimeError(f"boom in {name}")
            time.sleep(delay)
            self.produced[name] += 1
            yield FakeChunk(np.full(240, value(name, i), np.float32), np.zeros((1, 4)))

    def reply(self, message, sampling, *, llm, max_tokens, first_chunk, frames_per_token=None, voice=None, lane=None,
              speed=1.0):
        self.max_tokens[message.split()[0]] = max_tokens
        for chunk in self.synthesize(message, sampling, decode="stream", first_chunk=first_chunk,
                                     frames_per_token=frames_per_token, voice=voice):
            yield FakeChunk(chunk.samples, chunk.codes, "word ")


def value(name: str, i: int) -> float:
    return (sum(map(ord, name)) % 97) / 1000 + i / 10000


@contextlib.contextmanager
def in_process(synth, requests: list | None = None, store=None, voice_uploads: bool = True, **loaded):
    """The server's application over `synth` on a free port; `requests` collects (method, path) of each."""
    import uvicorn

    from minicpm_cli.serving.app import create_app
    from minicpm_cli.serving.run import listen, url_of
    from minicpm_cli.serving.service import Loaded, Service

    service = Service(lambda: Loaded(synth, model="fake", backend="fake", device="cpu", dtype="float32", **loaded),
                      warm_up=False, store=store)
    sock = listen("127.0.0.1", 0)
    app = create_app(service, voice_uploads=voice_uploads)
    if requests is not None:
        inner = app

        async def app(scope, receive, send):
            requests.append((scope["method"], scope["path"]))
            await inner(scope, receive, send)

    srv = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
    service.start(lambda ld: None, lambda e: None)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not (srv.started and service.ready):
        time.sleep(0.01)
    try:
        yield url_of("127.0.0.1", sock)
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
        service.worker.stop(timeout=30)


def f32(text: str, **extra) -> dict:
    return {"input": text, "response_format": "pcm_f32", "stream_format": "audio", **extra}


def test_requests_queue_in_arrival_order_and_never_mix():
    synth = FakeSynth()
    with in_process(synth) as url:
        results = {}

        def ask(name, n):
            results[name] = call(url, "POST", "/v1/audio/speech", f32(f"{name} n={n} delay=0.05"))

        threads = []
        for name, n in (("first", 60), ("second", 5), ("third", 5), ("fourth", 5)):
            threads.append(threading.Thread(target=ask, args=(name, n)))
            threads[-1].start()
            time.sleep(0.5)  # (each arrives while the first is still generating)
        for t in threads:
            t.join(timeout=30)
    assert synth.started == ["first", "second", "third", "fourth"]
    for name, (status, _, data) in results.items():
        got = np.frombuffer(data, "<f4").reshape(-1, 240)
        assert status == 200 and np.array_equal(got[:, 0], np.float32([value(name, i) for i in range(len(got))])), name
        assert (got == got[:, :1]).all()


def test_a_gone_client_stops_its_job_within_a_chunk_and_a_queued_one_never_starts():
    synth = FakeSynth()
    with in_process(synth) as url:
        u = urlsplit(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", "/v1/audio/speech", body=json.dumps(f32("long n=100 delay=0.5")),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read1(1 << 16)
        waiting = http.client.HTTPConnection(u.hostname, u.port, timeout=30)  # queued behind "long"
        waiting.request("POST", "/v1/audio/speech", body=json.dumps(f32("queued n=5")),
                        headers={"Content-Type": "application/json"})
        time.sleep(0.2)
        waiting.sock.shutdown(socket.SHUT_RDWR)
        waiting.close()
        time.sleep(0.2)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        at_close = synth.produced["long"]
        time.sleep(2.0)
        # the chunk being generated when the client left may still finish, no more
        assert synth.produced["long"] <= at_close + 2, (at_close, synth.produced["long"])
        status, _, _ = call(url, "POST", "/v1/audio/speech", f32("next n=2"))
        assert status == 200
    assert synth.started == ["long", "next"]


def test_failures_are_500s_or_cut_streams_and_the_server_stays_up(capfd):
    synth = FakeSynth()
    with in_process(synth) as url:
        error = error_of(*call(url, "POST", "/v1/audio/speech", f32("early fail=0"))[::2], 500)
        assert error["type"] == "server_error" and "RuntimeError: boom in early" in error["message"]
        u = urlsplit(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", "/v1/audio/speech", body=json.dumps(f32("late n=5 fail=2")),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        with pytest.raises(http.client.IncompleteRead):
            resp.read()
        conn.close()
        status, _, data = call(url, "POST", "/v1/audio/speech", {**f32("sse n=5 fail=2"), "stream_format": "sse"})
        events = sse_events(data)
        assert [e["type"] for e in events] == ["speech.audio.delta"] * 2 + ["error"]
        assert "boom in sse" in events[-1]["error"]["message"]
        status, _, data = call(url, "POST", "/v1/audio/reply", {"input": "talk n=3 fail=1", "response_format": "pcm"})
        assert [e["type"] for e in sse_events(data)] == ["reply.audio.delta", "reply.text.delta", "error"]
        assert call(url, "GET", "/health")[0] == 200
        assert call(url, "POST", "/v1/audio/speech", f32("fine n=2"))[0] == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err and "minicpm: error in a request: RuntimeError: boom in late" in err


def test_random_weights_force_every_requests_lengths():
    """A server of random weights (speed work) forces the lengths bench forces, and says so."""
    synth = FakeSynth()
    with in_process(synth, frames_per_token=10, reply_tokens=24) as url:
        props = json.loads(call(url, "GET", "/props")[2])
        assert props["forced_lengths"] == {"frames_per_token": 10, "reply_tokens": 24}
        assert call(url, "POST", "/v1/audio/speech", f32("read n=2"))[0] == 200
        assert call(url, "POST", "/v1/audio/reply", {"input": "talk n=2", "max_tokens": 500})[0] == 200
    assert synth.forced == {"read": 10, "talk": 10} and synth.max_tokens == {"talk": 24}
    synth = FakeSynth()
    with in_process(synth) as url:
        assert json.loads(call(url, "GET", "/props")[2])["forced_lengths"] is None
        assert call(url, "POST", "/v1/audio/reply", {"input": "talk n=2", "max_tokens": 500})[0] == 200
    assert synth.forced == {"talk": None} and synth.max_tokens == {"talk": 500}


def test_reply_usage_counts_the_llms_tokens_and_the_audio_frames_apart():
    """reply.done's usage: `output_tokens` are the reply text's LLM tokens (the fake's LLM tokenizer:
    one a word), `audio_frames` the audio frames spoken (here 4 a chunk), not one for the other."""

    class Talker(FakeSynth):
        def reply(self, message, sampling, **kw):
            for chunk in super().reply(message, sampling, **kw):
                yield FakeChunk(chunk.samples, np.zeros((4, 4)), "two words ")

    with in_process(Talker()) as url:
        status, _, data = call(url, "POST", "/v1/audio/reply", {"input": "talk n=3", "response_format": "pcm"})
    done = sse_events(data)[-1]
    assert status == 200 and done["type"] == "reply.done" and done["text"] == "two words " * 3, done
    assert done["usage"] == {"output_tokens": 6, "audio_frames": 12}


def test_speech_says_the_servers_time_to_first_audio():
    """`Server-Timing: first-chunk;dur=MS` on every speech response, streamed or whole."""
    with in_process(FakeSynth()) as url:
        for body in (f32("streamed n=2 delay=0.2"), {"input": "whole n=2 delay=0.2", "response_format": "wav"}):
            status, headers, _ = call(url, "POST", "/v1/audio/speech", body)
            name, dur = headers["server-timing"].split(";")
            assert status == 200 and name == "first-chunk" and 200 <= float(dur.removeprefix("dur=")) < 5000, headers


def test_a_body_that_is_not_a_json_object_says_what_it_must_be():
    """`curl -d '{...}'` sends its JSON as a form: the 422 says to send JSON with its Content-Type, as
    it does for an empty body or one that is not an object (it said "Input should be a valid
    dictionary or object to extract fields from", or "Field required", naming nothing)."""
    body = json.dumps({"input": "hello n=2"}).encode()
    with in_process(FakeSynth()) as url:
        for data, headers in ((body, {"Content-Type": "application/x-www-form-urlencoded"}),
                              (body, {"Content-Type": "text/plain"}), (b"", {}), (b"[1, 2]", {})):
            error = error_of(*call(url, "POST", "/v1/audio/speech", data, headers=headers)[::2], 422)
            assert error["message"].startswith("the body must be a JSON object sent with Content-Type: "
                                               "application/json ("), (data, headers, error)
        assert call(url, "POST", "/v1/audio/speech", body)[0] == 200  # (sent as JSON: spoken)


def test_raw_samples_with_timestamps_are_a_json_response():
    """`timestamps: true` on a `pcm` or `pcm_f32` request without stream_format: the JSON response,
    its audio the raw samples (the timestamps were dropped, the bare samples sent)."""
    from minicpm_cli.audio import to_pcm

    class Marked(FakeSynth):
        def synthesize(self, text, sampling, **kw):
            for i, chunk in enumerate(super().synthesize(text, sampling, **kw)):
                chunk.marks = [(240 * i, f"word{i} ")]  # (counted from the utterance's start)
                yield chunk

    expected = np.concatenate([np.full(240, value("said", i), np.float32) for i in range(3)])
    with in_process(Marked()) as url:
        for fmt, samples in (("pcm", to_pcm(expected, "s16").astype("<i2")), ("pcm_f32", expected.astype("<f4"))):
            status, headers, data = call(url, "POST", "/v1/audio/speech",
                                         {"input": "said n=3", "response_format": fmt, "timestamps": True})
            assert status == 200 and headers["content-type"] == "application/json", (fmt, data[:100])
            answer = json.loads(data)
            assert base64.b64decode(answer["audio"]) == samples.tobytes()
            assert (answer["response_format"], answer["samples"]) == (fmt, 720)
            assert [(c["text"], c["start_sample"], c["end_sample"]) for c in answer["timestamps"]] == [
                ("word0", 0, 240), ("word1", 240, 480), ("word2", 480, 720)]


# -- the thin client against the in-process application ----------------------------------------------


def test_say_asks_the_server_one_question_then_speaks(tmp_path):
    """`say` through a server: one GET /props, then the speech request; the local sinks write its samples."""
    from minicpm_cli.audio import to_pcm, wav_header

    requests: list = []
    expected = np.concatenate([np.full(240, value("hello", i), np.float32) for i in range(3)])
    with in_process(FakeSynth(), requests) as url:
        p = minicpm("say", "hello n=3", "--server", url, "-o", "-")
        assert p.returncode == 0, p.stderr.decode()
        assert p.stdout == wav_header(24000, "s16") + to_pcm(expected, "s16").astype("<i2").tobytes()
        assert requests == [("GET", "/props"), ("POST", "/v1/audio/speech")]
        requests.clear()
        p = minicpm("say", "hello n=3", "--server", url, "--pcm", "f32", "-o", str(tmp_path / "x.wav"))
        assert p.returncode == 0, p.stderr.decode()
        assert np.array_equal(sf.read(tmp_path / "x.wav", dtype="float32")[0], expected)
        assert requests == [("GET", "/props"), ("POST", "/v1/audio/speech")]


def test_say_through_a_server_imports_no_numpy(tmp_path):
    """A raw, streaming or 16-bit WAV sink gets its own bytes from the server (converted by the same
    `to_pcm`): `say -o -`, `say -o FILE.wav`, `say --raw` and `reply -o -` never import numpy or
    libsndfile's bindings."""
    code = ("import os, sys\n"
            "leave = os._exit\n"
            "def check(status):\n"
            "    bad = [m for m in ('numpy', 'soundfile', 'torch') if m in sys.modules]\n"
            "    sys.stderr.write(f'IMPORTED {bad}' if bad else 'CLEAN')\n"
            "    sys.stderr.flush()\n"
            "    leave(status)\n"
            "os._exit = check\n"
            "sys.argv = ['minicpm', *sys.argv[1:]]\n"
            "from minicpm_cli.cli.entry import main\nmain()\n")
    with in_process(FakeSynth()) as url:
        out = tmp_path / "x.wav"
        for args in (["say", "hello n=2", "-o", "-"], ["say", "hello n=2", "-o", str(out)],
                     ["say", "hello n=2", "--raw", "--pcm", "f32"], ["reply", "hello n=2", "-o", "-"]):
            p = subprocess.run([sys.executable, "-c", code, *args, "--server", url], capture_output=True, env=_env(),
                               timeout=120)
            assert p.returncode == 0 and p.stderr.decode().endswith("CLEAN"), (args, p.stderr.decode())
            assert len(p.stdout) >= 2 * 480 or out.stat().st_size == 44 + 2 * 480, args


def test_read_and_reply_send_their_request_before_a_chunk_is_asked_for():
    """The server works on a request while the command opens its sink (which loads numpy, libsndfile)."""
    from minicpm_cli.serving.client import Remote

    synth = FakeSynth()
    with in_process(synth) as url:
        remote = Remote.find(url, explicit=True)
        for name, start in (("read", lambda: remote.read("read n=2", greedy=True, seed=None, decode="stream",
                                                          first_chunk=25)),
                            ("talk", lambda: remote.reply("talk n=2", greedy=True, seed=None, temperature=0.7,
                                                          max_tokens=8, first_chunk=25))):
            chunks = start()
            end = time.monotonic() + 30
            while name not in synth.started and time.monotonic() < end:
                time.sleep(0.01)
            assert name in synth.started  # (and not one chunk asked for)
            samples = [c.samples for c in chunks if len(c.samples)]
            assert np.array_equal(np.concatenate(samples), np.concatenate(
                [np.full(240, value(name, i), np.float32) for i in range(2)]))


def test_ctrl_c_stops_say_lines_in_a_batch_through_a_server(tmp_path):
    """`say --lines --dir D --batch N` through a server: Ctrl-C leaves at once (130, one line, no file)
    and the requests in flight stop on the server (it said "interrupted", then waited for them to
    finish: minutes for long lines, the server generating all along)."""
    synth, ok, cut = FakeSynth(), tmp_path / "ok", tmp_path / "cut"
    with in_process(synth) as url:
        done = minicpm("say", "--lines", "--dir", str(ok), "--batch", "2", "--server", url, stdin=b"a n=2\nb n=3\nc n=1\n")
        assert done.returncode == 0, done.stderr.decode()
        assert [sf.info(ok / f"line-000{k}.wav").frames for k in (1, 2, 3)] == [480, 720, 240]
        p = subprocess.Popen([sys.executable, "-m", "minicpm_cli", "say", "--lines", "--dir", str(cut), "--batch",
                              "2", "--server", url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=_env())
        try:
            p.stdin.write(b"one n=600 delay=0.05\ntwo n=600 delay=0.05\n")  # (30 s of work each)
            p.stdin.close()
            lines = ("one", "two")  # (both in flight: which the server starts first is the threads' race)
            end = time.monotonic() + 60
            while not any(synth.produced.get(n) for n in lines) and time.monotonic() < end:
                time.sleep(0.02)
            p.send_signal(signal.SIGINT)
            assert p.wait(timeout=10) == 130
            assert p.stderr.read() == b"minicpm: interrupted\n" and p.stdout.read() == b""
        finally:
            p.kill()
            p.wait()
        at_exit = {n: synth.produced.get(n, 0) for n in lines}
        time.sleep(1.0)
        after = {n: synth.produced.get(n, 0) for n in lines}
        assert all(after[n] <= at_exit[n] + 2 for n in lines) and sum(after.values()) < 600, (at_exit, after)
    assert list(cut.iterdir()) == []


@contextlib.contextmanager
def not_minicpm():
    """Another HTTP server (404 for everything, as a web server on the default port would answer)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"detail": "Not Found"}')

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


def test_a_server_that_is_not_ours(tmp_path):
    """--server URL of another server is an error that says so; found at MINICPM_SERVER, it is passed by
    and the model loads here."""
    out = tmp_path / "x.wav"
    with not_minicpm() as url:
        _one_line_error(minicpm("say", "Hi.", "-o", str(out), "--server", url),
                        f"no minicpm server at {url} (GET /props answered 404)")
        p = minicpm("say", "Hi.", "--model", str(TINY), "--device", "cpu", "--greedy", "-o", str(out),
                    env=_env(MINICPM_SERVER=url))
        assert p.returncode == 0 and sf.info(out).frames > 0, p.stderr.decode()


@contextlib.contextmanager
def not_http():
    """Something listening that does not speak HTTP (an ssh daemon, a database) on a port."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

    threading.Thread(target=answer, daemon=True).start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def test_a_listener_that_does_not_speak_http_is_not_a_server(tmp_path):
    """--server naming a port where something else listens is a one-line error (was a traceback of
    http.client's BadStatusLine); found at MINICPM_SERVER, it is passed by and the model is looked
    for here."""
    out = str(tmp_path / "x.wav")
    with not_http() as url:
        _one_line_error(minicpm("say", "Hi.", "-o", out, "--server", url), f"no minicpm server at {url}", "HTTP")
        _one_line_error(minicpm("say", "Hi.", "-o", out, "--model", "/nonexistent/minicpm-model",
                                env=_env(MINICPM_SERVER=url)), "model directory not found")
    assert list(tmp_path.iterdir()) == []


# -- voices ---------------------------------------------------------------------------------------------

REF = ROOT / "tests" / "fixtures" / "voice_ref_a.wav"


def _samples_b64(samples: np.ndarray) -> str:
    return base64.b64encode(np.asarray(samples, "<f4").tobytes()).decode()


def _ref_samples() -> np.ndarray:
    from minicpm_cli.voices.reference import load_reference

    return load_reference(REF)


def test_voice_requests_in_process_resolve_names_samples_and_limits(tmp_path):
    """What reaches the model for each `voice`: a saved voice's samples, the default voice (None) for
    `default` and OpenAI's names unless one is saved, the thin client's samples; unknown names are a
    400 that lists the voices. voice_samples of 30 s pass the body limit, other fields do not get to
    use it."""
    from minicpm_cli.voices.reference import Voice
    from minicpm_cli.voices.store import VoiceStore

    store = VoiceStore(tmp_path)
    store.add("alice", REF)
    store.save("alloy", Voice(_ref_samples() * 0.5))
    ref = Voice(_ref_samples())
    synth = FakeSynth()
    with in_process(synth, store=store) as url:
        for text, voice in (("a", "alice"), ("b", "echo"), ("c", "alloy"), ("d", "default"), ("e", {"id": "alice"})):
            assert call(url, "POST", "/v1/audio/speech", f32(text, voice=voice))[0] == 200
        assert call(url, "POST", "/v1/audio/speech", f32("f", voice_samples=_samples_b64(ref.samples)))[0] == 200
        assert call(url, "POST", "/v1/audio/reply", {"input": "g n=1", "voice": "alice"})[0] == 200
        error = error_of(*call(url, "POST", "/v1/audio/speech", f32("h", voice="bob"))[::2], 400)
        assert "voices: default, alice, alloy;" in error["message"] and error["param"] == "voice"
        assert "h" not in synth.started
        store.add("bob", REF)  # (the directory is read at each request: a voice saved meanwhile is there)
        assert call(url, "POST", "/v1/audio/speech", f32("h", voice="bob"))[0] == 200

        long = (0.5 * np.sin(np.arange(30 * 16000) / 7)).astype(np.float32)
        assert call(url, "POST", "/v1/audio/speech", f32("i", voice_samples=_samples_b64(long)))[0] == 200
        status, _, data = call(url, "POST", "/v1/audio/speech",
                               f32("j", voice_samples=_samples_b64(long), pad="x" * (protocol.MAX_BODY_BYTES - 100)))
        error_of(status, data, 413)
        too_long = np.concatenate([long, long[:16000]])
        error = error_of(*call(url, "POST", "/v1/audio/speech", f32("k", voice_samples=_samples_b64(too_long)))[::2], 400)
        assert "31.0 s of audio" in error["message"] and error["param"] == "voice_samples"

        listed = json.loads(call(url, "GET", "/v1/voices")[2])
        assert [v["id"] for v in listed["data"]] == ["default", "alice", "alloy", "bob"]
        default, alice = listed["data"][:2]
        assert default["kind"] == "builtin" and "echo" in default["aliases"] and "alloy" not in default["aliases"]
        assert alice["kind"] == "saved" and alice["seconds"] == 2.37 and alice["source"] == "voice_ref_a.wav"
        assert abs(alice["created"] - time.time()) < 600
        assert json.loads(call(url, "GET", "/v1/audio/voices")[2]) == {"voices": ["default", "alice", "alloy", "bob"]}
        assert json.loads(call(url, "GET", "/props")[2])["voices"] == ["default", "alice", "alloy", "bob"]
    v = synth.voices
    assert v["a"].digest == v["e"].digest == v["f"].digest == v["g"].digest == v["h"].digest == ref.digest
    assert v["b"] is None and v["d"] is None
    assert v["c"].digest == Voice(ref.samples * 0.5).digest
    assert np.array_equal(v["i"].samples, long)
    assert "j" not in synth.started and "k" not in synth.started


def upload(url: str, fields: dict, file: tuple[str, bytes] | None, headers: dict | None = None):
    """POST /v1/voices as multipart/form-data: (status, the JSON answer)."""
    boundary = "minicpm-test-boundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    if file is not None:
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{file[0]}"\r\n'
                     f"Content-Type: application/octet-stream\r\n\r\n".encode() + file[1] + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    status, _, data = call(url, "POST", "/v1/voices", body,
                           {"Content-Type": f"multipart/form-data; boundary={boundary}", **(headers or {})})
    return status, json.loads(data)


def test_voice_uploads_in_process(tmp_path):
    """POST /v1/voices: the checks of `minicpm voice add`, 409 for a taken name unless force, and none
    at all where the server refuses uploads (reachable from other machines without a key)."""
    from minicpm_cli.voices.store import VoiceStore

    store = VoiceStore(tmp_path / "voices")
    wav = REF.read_bytes()
    with in_process(FakeSynth(), store=store) as url:
        def post(name, data=wav, filename="me.wav", **form):
            return upload(url, {"name": name, **form}, (filename, data))

        status, body = post("me")
        assert status == 200 and body == {"id": "me", "object": "voice", "kind": "saved", "seconds": 2.37,
                                          "created": body["created"], "source": "me.wav"}
        np.testing.assert_array_equal(store.load("me").samples, _ref_samples())
        status, body = post("me")
        assert status == 409 and body["error"]["code"] == "voice_exists" and "force=true" in body["error"]["message"]
        short = io.BytesIO()
        sf.write(short, np.full(8000, 0.3, np.float32), 16000, format="WAV", subtype="FLOAT")
        status, body = post("me", short.getvalue(), force="true", filename="short.wav")
        assert status == 200 and body["seconds"] == 0.5 and body["source"] == "short.wav"
        assert len(store.load("me").samples) == 8000
        for name, data, words in (("x", b"not audio", ["not audio"]), ("x", bytes(200), ["not audio"]),
                                  ("a/b", wav, ["cannot name"]), ("default", wav, ["model's own voice"])):
            status, body = post(name, data)
            assert status == 400 and all(w in body["error"]["message"] for w in words), body
        assert store.names() == ["me"]
        status, body = upload(url, {"name": "y"}, None)
        assert status == 422 and "file" in body["error"]["message"]
        assert sorted(p.name for p in store.root.iterdir()) == ["me.wav"]  # (nothing else written, no temporary)
    with in_process(FakeSynth(), store=store, voice_uploads=False) as url:
        status, body = upload(url, {"name": "z"}, ("z.wav", wav))
        assert status == 403 and "--api-key" in body["error"]["message"]
    assert store.names() == ["me"]


def test_an_older_server_without_voices_is_an_error_not_the_default_voice():
    from minicpm_cli.serving.client import Remote
    from minicpm_cli.errors import UsageError
    from minicpm_cli.voices.reference import Voice

    remote = Remote("http://127.0.0.1:1", {"sample_rate": 24000, "model": "m"}, None)
    with pytest.raises(UsageError, match="does not take voices"):
        remote.take_voice(Voice(_ref_samples()))
    remote.take_voice(None)  # (no voice asked for: nothing to refuse)


def test_an_older_server_without_speed_is_an_error_not_another_tempo():
    """A server that does not list `speed` (whose reply endpoint would drop it) is refused before
    anything is sent; speed 1 asks nothing of it."""
    from minicpm_cli.serving.client import Remote
    from minicpm_cli.errors import UsageError

    remote = Remote("http://127.0.0.1:1", {"sample_rate": 24000, "model": "m"}, None)
    with pytest.raises(UsageError, match="does not take --speed"):
        remote.reply("Hi.", greedy=True, seed=None, temperature=0.7, max_tokens=5, first_chunk=25, speed=1.5)
    with pytest.raises(UsageError, match="does not take --speed"):
        remote.read("Hi.", greedy=True, seed=None, decode="stream", first_chunk=25, speed=0.5)
    assert remote._speed(1.0) is None


# The tiny voice checkpoint served, with saved voices of its own; the commands' results compared with
# the same commands run with the model in-process.
VTEXT = "Hello world."


@pytest.fixture(scope="module")
def voice_data(tmp_path_factory):
    """(the server's XDG_DATA_HOME: alice = REF, alloy = REF at half level; the client's: carol = REF)"""
    from minicpm_cli.voices.reference import Voice
    from minicpm_cli.voices.store import VoiceStore

    server_data, client_data = tmp_path_factory.mktemp("server-data"), tmp_path_factory.mktemp("client-data")
    store = VoiceStore(server_data / "minicpm" / "voices")
    store.add("alice", REF)
    store.save("alloy", Voice(_ref_samples() * 0.5))
    VoiceStore(client_data / "minicpm" / "voices").add("carol", REF)
    return server_data, client_data


@pytest.fixture(scope="module")
def voiced(voice_dir, voice_data):
    s = Served(model=voice_dir, env=_env(XDG_DATA_HOME=str(voice_data[0])))
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


VOICE_CASES = {  # (arguments, stdin); each test adds --voice and where to run
    "file": (["say", VTEXT, "--greedy", "-o", "{dir}/a.wav"], b""),
    "stdout": (["say", VTEXT, "--seed", "1", "-o", "-"], b""),
    "reply": (["reply", "What's your name?", "--greedy", "--max-tokens", "12", "-o", "-"], b""),
}


def voice_outcome(case: str, where: list[str], tmp: Path, client_data: Path) -> Outcome:
    args, stdin = VOICE_CASES[case]
    d = Path(tempfile.mkdtemp(dir=tmp))
    p = minicpm(*[a.replace("{dir}", str(d)) for a in args], *where, stdin=stdin,
                env=_env(XDG_DATA_HOME=str(client_data)))
    return Outcome(p.returncode, p.stdout, p.stderr.decode().replace(str(d), "{dir}"),
                   {f.name: f.read_bytes() for f in sorted(d.iterdir())})


@pytest.fixture(scope="module")
def voice_local(voice_dir, voice_data, tmp_path_factory):
    """What each case writes with the model in-process (--local), for a --voice REF, run once each."""
    tmp, cache = tmp_path_factory.mktemp("voice-local"), {}

    def get(case: str, ref: str = str(REF)) -> Outcome:
        if (case, ref) not in cache:
            where = ["--local", "--model", str(voice_dir), "--device", "cpu", "--voice", ref]
            cache[case, ref] = voice_outcome(case, where, tmp, voice_data[1])
            assert cache[case, ref].returncode == 0, cache[case, ref].stderr
        return cache[case, ref]

    return get


def test_say_voice_name_writes_what_voice_file_writes(voice_local):
    """A saved voice is the samples --voice FILE reads: the same bytes."""
    by_name, by_file = voice_local("file", "carol"), voice_local("file")
    assert by_name.files == by_file.files and by_file.files["a.wav"][:4] == b"RIFF"


@pytest.mark.parametrize("case", list(VOICE_CASES))
@pytest.mark.parametrize("ref", ["file", "saved"])
def test_cli_voice_through_the_server_writes_what_local_writes(voiced, voice_local, voice_data, tmp_path, case, ref):
    """--voice FILE, and a voice saved on the client's side only (the server has no `carol`): the
    samples go with the request, and the bytes are the local path's."""
    remote = voice_outcome(case, ["--server", voiced.url, "--voice", str(REF) if ref == "file" else "carol"],
                           tmp_path, voice_data[1])
    here = voice_local(case)
    assert remote.returncode == 0, remote.stderr
    assert (remote.stdout, remote.files, remote.stderr) == (here.stdout, here.files, here.stderr)


def test_the_voice_field_speaks_saved_voices(voiced, voice_local, local):
    """voice=alice (saved on the server) is --voice FILE's audio; OpenAI's names speak the default voice
    (the voice checkpoint without a voice is the base checkpoint: `local`'s bytes), unless saved."""
    c = client(voiced.url)

    def wav(voice, text=VTEXT, **extra) -> bytes:
        return c.audio.speech.create(model="tts-1", voice=voice, input=text, response_format="wav",
                                     extra_body={"greedy": True, **extra}).content

    alice = wav("alice")
    assert alice == voice_local("file").files["a.wav"]
    assert wav("echo", TEXT) == wav("default", TEXT) == local("file").files["a.wav"]
    alloy = wav("alloy")
    assert alloy != alice and alloy != wav("shimmer")
    assert alloy == wav("default", voice_samples=_samples_b64(_ref_samples() * 0.5))
    listed = json.loads(call(voiced.url, "GET", "/v1/voices")[2])
    assert [v["id"] for v in listed["data"]] == ["default", "alice", "alloy"]
    with pytest.raises(openai.BadRequestError) as e:
        wav("carol")
    assert "voices: default, alice, alloy" in str(e.value)


def test_voice_upload_then_speak(voiced, voice_local, voice_data):
    status, body = upload(voiced.url, {"name": "dave"}, ("dave.wav", REF.read_bytes()))
    assert status == 200 and body["id"] == "dave", body
    assert (voice_data[0] / "minicpm" / "voices" / "dave.wav").is_file()
    status, _, data = call(voiced.url, "POST", "/v1/audio/speech", {"input": VTEXT, "voice": "dave", "greedy": True})
    assert status == 200 and data == voice_local("file").files["a.wav"]
    assert json.loads(call(voiced.url, "GET", "/v1/audio/voices")[2])["voices"] == ["default", "alice", "alloy",
                                                                                     "dave"]


def test_protocol_voice_limits_are_the_voice_modules():
    from minicpm_cli.voices import reference as voice

    assert protocol.MAX_VOICE_SECONDS == voice.MAX_SECONDS
    longest = base64.b64encode(np.zeros(int(voice.MAX_SECONDS * voice.SAMPLE_RATE), "<f4").tobytes())
    assert len(longest) == protocol.MAX_VOICE_SAMPLES_CHARS
