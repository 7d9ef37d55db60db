"""`minicpm bench` smoke test on the tiny checkpoint (no timing is asserted) and forced lengths."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minicpm_cli.engine.pipeline import Synthesizer
from minicpm_cli.engine.sampling import Sampling
from minicpm_cli.engine.synthetic import SyntheticSpec

from conftest import pythonpath

ROOT = Path(__file__).resolve().parents[1]


def test_bench_smoke(tiny_dir, tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-m", "minicpm_cli", "bench", "--model", str(tiny_dir), "--device", "cpu",
                        "--runs", "1", "--warmup", "1", "--max-tokens", "24", "--backend", "eager", "--json", str(out)],
                       capture_output=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr.decode()
    table = p.stdout.decode()
    assert "| eager | read |" in table and "| eager | reply |" in table
    assert "bench:" not in table  # progress goes to stderr
    assert "bench:" in p.stderr.decode()
    result = json.loads(out.read_text())
    env_ = result["environment"]
    for key in ("device", "torch", "commit", "date", "python"):
        assert key in env_
    assert result["forced_lengths"] is False
    entries = {(e["backend"], e["workload"]): e for e in result["results"]}
    assert set(entries) == {("eager", "read"), ("eager", "reply")}
    assert len(entries["eager", "read"]["samples"]) == 3
    assert len(entries["eager", "reply"]["samples"]) == 6
    for e in entries.values():
        for s in e["samples"]:
            assert s["ttfa_ms"] > 0 and s["audio_s"] > 0 and s["rtf"] > 0 and s["frames"] > 0
            assert s["ttfa_ms"] <= s["total_s"] * 1e3
        for key in ("ttfa_ms", "rtf"):
            assert e[key]["p50"] <= e[key]["p90"]
        assert e["llm_prefill_ms"] > 0 and e["tts_ms_per_step"] > 0 and e["codec_ms_per_chunk"] > 0
        assert e["load_s"] > 0 and e["warmup_s"] > 0
        assert e["tts_call_samples"] and e["codec_samples_ms"]
    reply = entries["eager", "reply"]
    assert reply["llm_ms_per_token"] > 0 and reply["llm_gb_per_s"] > 0
    assert reply["llm_weight_bytes_per_token"] > 0


def test_random_weights_and_forced_lengths():
    """The --random-weights path (tiny sizes here) with the lengths bench forces."""
    synth = Synthesizer.load(None, random_weights=True, spec=SyntheticSpec.tiny(), device="cpu")
    text = "The quick brown fox jumps over the lazy dog."
    chunks = list(synth.synthesize(text, Sampling(seed=1), frames_per_token=10))
    n = len(synth.tokenizers.encode_bert(text))
    assert sum(len(c.codes) for c in chunks) == 10 * n
    assert sum(len(c.samples) for c in chunks) == 10 * n * 512
    chunks = list(synth.reply("What's your name?", Sampling(seed=1), max_tokens=24, frames_per_token=10))
    spoken = "".join(c.text for c in chunks)
    frames = sum(len(c.codes) for c in chunks)
    assert frames == 10 * len(synth.tokenizers.encode_bert(spoken))
    assert not torch.isnan(torch.from_numpy(chunks[0].samples)).any()


def test_forced_replies_say_one_text_whatever_the_prompt_seed_voice_or_batch(voice_dir):
    """With forced lengths a reply's tokens are FORCED_REPLY_TEXT's (each still chosen, then replaced):
    the same text, so the same pieces before the first audio, for every request a bench compares,
    alone or as a batch's stream. A random LLM's own tokens had a kept voice's replies wait for 3
    pieces where the default voice's waited for 2 (+19 ms on an H100, read as the voice's cost)."""
    import functools

    from minicpm_cli.engine.batching import in_order
    from minicpm_cli.engine.llm import FORCED_REPLY_TEXT
    from minicpm_cli.voices.reference import Voice

    synth = Synthesizer.load(str(voice_dir), device="cpu", dtype="float32", rows=2)
    tok = synth.tokenizers
    ids = tok.encode_llm(FORCED_REPLY_TEXT)
    said = tok.llm.decode(ids)
    # every token a whole word or mark, and the TTS's first text chunk (10 tokens) filled by the third
    # piece of 3 tokens, not the second
    assert [tok.llm.decode([i]).strip() for i in ids] == re.findall(r"'?\w+|[.,?!]", FORCED_REPLY_TEXT)
    chunk = synth.tts.config.streaming_text_chunk_size
    assert len(tok.encode_bert(tok.llm.decode(ids[:6]))) < chunk <= len(tok.encode_bert(tok.llm.decode(ids[:9])))
    voice = Voice.load(ROOT / "tests" / "fixtures" / "voice_ref_a.wav")

    def reply(prompt, seed, lane=None, v=None):
        return synth.reply(prompt, Sampling(seed=seed), max_tokens=24, frames_per_token=10, voice=v, lane=lane)

    for prompt, seed, v in (("What's your name?", 1, None), ("Tell me a joke.", 2, None),
                            ("What's your name?", 1, voice)):
        assert "".join(c.text for c in reply(prompt, seed, v=v)) == said
    jobs = [functools.partial(reply, p, s) for p, s in (("What's your name?", 3), ("Tell me a joke.", 4))]
    for chunks in in_order(synth.batch(2), jobs, batch=2):
        assert "".join(c.text for c in chunks) == said


def test_startup_times_fresh_processes_phase_by_phase(tiny_dir):
    """`bench --startup` on the tiny checkpoint: two fresh `say` processes, each timed from exec to its
    first audio sample and to its exit, with the phases the child noted (imports, tensors read)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "s.json")
        p = subprocess.run([sys.executable, "-m", "minicpm_cli", "bench", "--startup", "--model", str(tiny_dir),
                            "--backend", "eager", "--device", "cpu", "--json", out], capture_output=True, timeout=300,
                           env={**os.environ, "MINICPM_SERVER": "", "PYTHONPATH": pythonpath()})
        assert p.returncode == 0, p.stderr.decode()
        runs = json.loads(open(out).read())
    assert [r["which"] for r in runs] == ["first", "second"]
    for r in runs:
        assert r["exit_code"] == 0, r
        assert 0 < r["exec_to_start"] + r["imports"] < r["loaded"] <= r["first_byte"] <= r["done"], r
        assert r["gbytes"] > 0.001 and r["tensors"] > 0  # the tiny checkpoint's ~8 MB passed the reader
        assert {"load_tokenizers", "load_llm", "tensors"} <= set(r["spans"]), r["spans"]
    table = p.stdout.decode()
    assert table.count("| eager | first |") == 1 and table.count("| eager | second |") == 1


def test_startup_needs_a_checkpoint_directory():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "minicpm_cli", "bench", "--startup", "--random-weights"],
                       capture_output=True, timeout=60, env={**os.environ, "PYTHONPATH": pythonpath()})
    assert p.returncode == 2 and b"--startup needs --model DIR" in p.stderr


def test_bench_voice(voice_dir, tmp_path, monkeypatch):
    """`bench --voice FILE` on the tiny voice checkpoint (in-process, one short request per workload):
    the reference's encoding, the encoder's load, TTFA with the voice cached and as a new file beside
    the default voice's, for read and reply."""
    from typer.testing import CliRunner

    from minicpm_cli.cli import bench
    from minicpm_cli.cli.app import app

    from conftest import FIXTURES

    monkeypatch.setattr(bench, "READ_TEXTS", ("How are you today?",))
    monkeypatch.setattr(bench, "REPLY_PROMPTS", ("What's your name?",))
    monkeypatch.setattr(bench, "REPLY_WARMUP", "Hi.")
    out = tmp_path / "bench.json"
    ref = str(FIXTURES / "voice_ref_a.wav")
    r = CliRunner().invoke(app, ["bench", "--model", str(voice_dir), "--device", "cpu", "--runs", "1", "--warmup", "0",
                                 "--max-tokens", "8", "--backend", "eager", "--voice", ref, "--json", str(out)])
    assert r.exit_code == 0, r.output
    table = r.stdout
    assert f"Voice {ref} (2.37 s)" in table and "| encoder load (s) |" in table
    voiced = [line for line in table.splitlines() if line.startswith("| eager |") and line.count("|") == 10]
    assert [line.split("|")[2].strip() for line in voiced] == ["read", "reply"]
    entries = {e["workload"]: e for e in json.loads(out.read_text())["results"]}
    read, reply = entries["read"]["voice"], entries["reply"]["voice"]
    assert read["encoder_load_s"] > 0 and reply["encoder_load_s"] is None  # (loaded once, at the first voice)
    for v in (read, reply):
        assert v["seconds"] == 2.37 and v["prompt_tokens"] > 59  # (59 audio placeholders, and the turn's words)
        assert v["features_ms"]["p50"] > 0 and v["encode_ms"]["p50"] > 0
        n = 1  # (one request, one run: seed 0, a short one on this checkpoint)
        # (the default voice timed again in the voice's loop, the same way: not the workload's figure)
        assert len(v["ttfa_default_samples_ms"]) == len(v["ttfa_cached_samples_ms"]) == len(v["ttfa_new_samples_ms"]) == n
        for key in ("ttfa_default_ms", "ttfa_cached_ms", "ttfa_new_ms"):
            assert 0 < v[key]["p50"] <= v[key]["p90"]


def test_bench_random_weights_voice(tmp_path, monkeypatch):
    """`bench --random-weights --voice FILE` (tiny sizes here): the audio encoder is drawn at the first
    voice, timed as its load; encode is features + encoder + projection + pooling of the file."""
    from typer.testing import CliRunner

    from minicpm_cli.cli import bench
    from minicpm_cli.cli.app import app

    from conftest import FIXTURES

    monkeypatch.setattr(SyntheticSpec, "full", SyntheticSpec.tiny)
    monkeypatch.setattr(bench, "READ_TEXTS", ("How are you today?",))
    monkeypatch.setattr(bench, "REPLY_PROMPTS", ("What's your name?",))
    monkeypatch.setattr(bench, "REPLY_WARMUP", "Hi.")
    from minicpm_cli.engine import loading

    monkeypatch.setattr(loading, "FORCED_REPLY_TOKENS", 4)  # (the lengths random weights force, read at use)
    monkeypatch.setattr(loading, "FORCED_FRAMES_PER_TOKEN", 2)
    out = tmp_path / "bench.json"
    ref = str(FIXTURES / "voice_ref_a.wav")
    r = CliRunner().invoke(app, ["bench", "--random-weights", "--device", "cpu", "--runs", "1", "--warmup", "0",
                                 "--backend", "eager", "--voice", ref, "--json", str(out)])
    assert r.exit_code == 0, r.output
    result = json.loads(out.read_text())
    assert result["forced_lengths"] is True
    entries = {e["workload"]: e for e in result["results"]}
    read, reply = entries["read"]["voice"], entries["reply"]["voice"]
    assert read["encoder_load_s"] > 0 and reply["encoder_load_s"] is None
    for v in (read, reply):
        assert v["prompt_tokens"] > 59 and v["features_ms"]["p50"] > 0 and v["encode_ms"]["p50"] > 0
        for key in ("ttfa_default_ms", "ttfa_cached_ms", "ttfa_new_ms"):
            assert 0 < v[key]["p50"] <= v[key]["p90"]


def test_bench_voice_usage_errors(voice_dir, tmp_path):
    from conftest import FIXTURES

    env = {**os.environ, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1"}
    for extra in (["--server", "http://127.0.0.1:1"], ["--startup", "--model", str(voice_dir)]):
        p = subprocess.run([sys.executable, "-m", "minicpm_cli", "bench", *extra, "--voice",
                            str(FIXTURES / "voice_ref_a.wav")], capture_output=True, env=env, timeout=120)
        assert p.returncode == 2 and b"--voice times voice cloning" in p.stderr, p.stderr.decode()
    p = subprocess.run([sys.executable, "-m", "minicpm_cli", "bench", "--model", str(voice_dir), "--voice",
                        str(tmp_path / "none.wav")], capture_output=True, env=env, timeout=120)
    assert p.returncode == 1 and b"none.wav: no such file" in p.stderr and p.stdout == b""


def test_arrivals_are_a_seeded_poisson_process():
    from minicpm_cli.cli.bench_many import arrivals

    assert arrivals(4, None) == [0.0] * 4
    a = arrivals(2000, 50.0, seed=3)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:])) and a == arrivals(2000, 50.0, seed=3)
    assert abs(a[-1] / 1999 - 1 / 50) < 0.1 / 50  # mean gap 1/rate
    assert arrivals(5, 50.0, seed=4) != arrivals(5, 50.0, seed=3)


@pytest.mark.parametrize("rate", [None, 4.0])
def test_bench_concurrency_at_once_and_arriving(tiny_dir, tmp_path, rate):
    """N requests in one batch, started together or arriving at `rate` a second: every request is
    timed from its own arrival (a late one's TTFA is not its wait before it arrived)."""
    out = tmp_path / "many.json"
    env = {**os.environ, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1"}
    extra = [] if rate is None else ["--arrival-rate", str(rate)]
    p = subprocess.run([sys.executable, "-m", "minicpm_cli", "bench", "--model", str(tiny_dir), "--device", "cpu",
                        "--dtype", "float32", "--backend", "eager", "--concurrency", "3", "--workload", "read",
                        "--runs", "1", "--warmup", "0", "--json", str(out), *extra],
                       capture_output=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr.decode()
    assert "| eager | read | 3 |" in p.stdout.decode()
    assert ("Arrivals: 4 requests a second" in p.stdout.decode()) == (rate is not None)
    (entry,) = json.loads(out.read_text())["results"]
    moments = [s["arrival_s"] for s in entry["samples"]]
    if rate is None:
        assert moments == [0.0, 0.0, 0.0]
    else:
        assert moments[0] == 0.0 and moments[1] > 0 and moments[2] > moments[1]
    for s in entry["samples"]:
        assert 0 < s["ttfa_ms"] <= s["total_s"] * 1e3 and s["audio_s"] > 0 and s["rtf"] > 0
    assert entry["audio_s_per_s"] > 0


def test_arrival_rate_needs_concurrency():
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    for args in (["--arrival-rate", "5"], ["--concurrency", "2", "--arrival-rate", "0"]):
        p = subprocess.run([sys.executable, "-m", "minicpm_cli", "bench", "--random-weights", "--device", "cpu", *args],
                           capture_output=True, env=env, timeout=120)
        assert p.returncode == 2 and b"--arrival-rate" in p.stderr and b"Traceback" not in p.stderr


def test_records_time_each_request_from_its_arrival():
    """A request that arrived 0.5 s after the start: its TTFA, total and RTF count from then."""
    from minicpm_cli.cli.bench_many import _records

    t0, rate = 100.0, 24000
    (rec,) = _records([{"text": "x", "seed": 1, "first": t0 + 0.6, "end": t0 + 1.0, "samples": rate,
                        "error": None, "arrival": 0.5}], t0, rate)
    assert rec["arrival_s"] == 0.5 and abs(rec["ttfa_ms"] - 100) < 1e-6 and abs(rec["total_s"] - 0.5) < 1e-9
    assert abs(rec["rtf"] - 0.5) < 1e-9


def test_stage_timers_put_back_what_each_stage_had():
    """The timers wrap a stage's method and unwrap it after a workload: a codec whose `decode` a backend
    replaced (the CUDA-graph codec's) gets that replacement back, not the class's eager method (the
    second workload of a bench process ran the eager codec: 4.7 ms a chunk against 2.0, H100)."""
    from minicpm_cli.cli.bench import Clock, StageTimers

    class Stage:
        def forward(self, ids):
            return "class"

        generate = decode = forward

    llm, tts, codec = Stage(), Stage(), Stage()
    graphs = lambda codes: "graphs"  # noqa: E731
    codec.decode = graphs
    synth = type("Synth", (), {"llm": llm, "tts": tts, "codec": codec})()
    timers = StageTimers(synth, Clock(torch.device("cpu")))
    with timers:
        assert codec.decode([1]) == "graphs" and llm.forward([1]) == "class"
    assert codec.decode is graphs and "forward" not in vars(llm) and "generate" not in vars(tts)
    assert len(timers.codec) == 1 and len(timers.decode) == 1
    with timers:  # a second workload times the same stages again
        codec.decode([1])
    assert codec.decode is graphs and len(timers.codec) == 2
