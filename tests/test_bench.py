"""`minicpm bench` smoke test on the tiny checkpoint (no timing is asserted) and forced lengths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from minicpm_cli.pipeline import Synthesizer
from minicpm_cli.sampling import Sampling
from minicpm_cli.synthetic import SyntheticSpec

ROOT = Path(__file__).resolve().parents[1]


def test_bench_smoke(tiny_dir, tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
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
                           env={**os.environ, "MINICPM_SERVER": ""})
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
                       capture_output=True, timeout=60)
    assert p.returncode == 2 and b"--startup needs --model DIR" in p.stderr
