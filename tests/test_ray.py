"""Scale-out: `minicpm bulk` (in this process and on Ray Data) and `minicpm serve --ray` (Ray Serve).

One local Ray cluster (2 CPUs, no GPU) is started here and shared by the module; the commands run as
users run them, in subprocesses that join it with `--ray ADDRESS`. What must hold: a bulk job on two
actors, on two nodes (a head and a worker node started with `ray start`, tools/ray_cluster.py), writes
the files `say --lines --dir` writes, byte for byte; an actor killed mid-job is
replaced, its batches run again, and every item still has exactly one complete file and one manifest
line; a second run changes nothing; a run after a crash redoes what the crash lost and only that;
per-item seeds are `say --seed <derived>`'s. Serve's replicas answer the official `openai` client with
`minicpm say`'s bytes, concurrently, streamed and whole, behind the API key; a replica killed under
load fails its requests with an error (never a response cut short that looks whole), and later
requests succeed. Then the pieces without a cluster: reading items, seeds, the batch function over a
fake model, Serve's options.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("ray", reason="the ray extra (ray[data,serve]) is not installed")
try:  # the official client, for the Serve tests (they skip without it)
    import openai
except ImportError:
    openai = None

from minicpm_cli.engine import memory  # noqa: E402
from minicpm_cli.scale import bulk  # noqa: E402
from minicpm_cli.errors import OptionError, UsageError  # noqa: E402

from conftest import FIXTURES, TINY, pythonpath  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*")  # (Ray's own pydantic usage)

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["--model", str(TINY), "--device", "cpu", "--dtype", "float32"]
# 40 texts the tiny model reads in well under a second each (greedy): the job, not the model, is tested
TEXTS = ["Bad again.", "One.", "Left.", "Rock.", "Say tree.", "Say snow.", "Rain.", "Say up.", "Tree again.",
         "Say sun.", "Say fine.", "Cold again.", "Say cat.", "Say gold.", "Say milk.", "Now again.", "Say one.",
         "Stop again.", "Cold.", "Tree.", "Say salt.", "Fine.", "Moon.", "Say now.", "Rice.", "Say two.",
         "Right again.", "Sand again.", "Go.", "Say moon.", "Left again.", "Say fire.", "Milk.", "Say rain.",
         "Gold.", "Up.", "Two.", "Hot.", "Good again.", "Say ok."]
LONG = "Red again."  # about 9 s of audio: long enough to be in flight when a replica dies
KEY = "ray-key"
BLOCK_RAY = "import sys; sys.modules['ray'] = None\n"  # `import ray` fails: as if the extra were not installed


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MINICPM_DEBUG", "MINICPM_API_KEY", "RAY_ADDRESS")}
    # (RAY_DEDUP_LOGS=0: each actor's lines reach the driver's stderr with its pid, even when alike)
    return {**env, "PYTHONPATH": pythonpath(), "HF_HUB_OFFLINE": "1", "MINICPM_SERVER": "", "RAY_DEDUP_LOGS": "0",
            **extra}


def minicpm(*args: str, stdin: bytes = b"", env: dict | None = None, prelude: str = "", timeout: float = 300):
    """The command as a user runs it (`prelude`: Python run first, in the same process)."""
    code = f"{prelude}import sys\nsys.argv = ['minicpm', *sys.argv[1:]]\nfrom minicpm_cli.cli.entry import main\nmain()\n"
    return subprocess.run([sys.executable, "-c", code, *args], input=stdin, capture_output=True,
                          env=env or _env(), timeout=timeout, cwd=ROOT)


def one_line_error(p, *needles: str, status: int = 1) -> str:
    err = p.stderr.decode()
    lines = [line for line in err.splitlines() if line.strip()]
    assert p.returncode == status and lines and lines[-1].startswith("minicpm: error: "), err
    assert "Traceback" not in err, err
    for n in needles:
        assert n in lines[-1], err
    return lines[-1]


def snapshot(d: Path) -> dict[str, tuple[bytes, int]]:
    return {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in sorted(d.iterdir())}


def entries(d: Path) -> list[dict]:
    text = (d / bulk.MANIFEST).read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def check_manifest(d: Path, expected: dict[str, str]) -> list[dict]:
    """Exactly one line per item (id -> text), each naming its complete file; no file that is not an
    item's, no temporary file left."""
    es = entries(d)
    assert sorted(e["id"] for e in es) == sorted(expected)
    for e in es:
        f = d / e["file"]
        assert e["text"] == expected[e["id"]] and f.stat().st_size == e["bytes"], e
        assert e["seconds"] == pytest.approx(sf.info(f).frames / 24000, abs=1e-4), e
    assert sorted(f.name for f in d.iterdir()) == sorted([e["file"] for e in es] + [bulk.MANIFEST])
    return es


# -- the cluster and the references ---------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for this module (its address, for `--ray`). Serve's proxy gets more time to
    start than its default 5 s: a loaded CI machine takes longer to import it."""
    import ray

    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
    """TEXTS as a text file (with blank lines, which are not items), and what `say --lines --dir`
    writes for it: line-0001.wav ... line-0040.wav."""
    d = tmp_path_factory.mktemp("lines")
    items = d / "items.txt"
    items.write_text("\n".join(TEXTS[:10]) + "\n\n  \n" + "\n".join(TEXTS[10:]) + "\n")
    ref = d / "ref"
    ref.mkdir()
    p = minicpm("say", "--lines", "--greedy", "--dir", str(ref), "-f", str(items), *MODEL)
    assert p.returncode == 0, p.stderr.decode()
    files = {f.name: f.read_bytes() for f in ref.iterdir()}
    assert sorted(files) == [f"line-{n:04d}.wav" for n in range(1, 41)]
    return items, files


def texts_by_id() -> dict[str, str]:
    return {f"line-{n:04d}": t for n, t in enumerate(TEXTS, 1)}


# -- bulk on Ray ------------------------------------------------------------------------------------


def test_bulk_on_two_nodes_writes_what_say_lines_dir_writes_and_a_second_run_changes_nothing(lines, tmp_path):
    """A job across a head and a worker node started with `ray start` (tools/ray_cluster.py), one CPU
    each, so one actor on each: `say`'s bytes."""
    from conftest import _tool

    items, ref = lines
    out = tmp_path / "out"
    marks = tmp_path / "trace.jsonl"  # (each actor marks its model ready, with its pid)
    with _tool("ray_cluster").two_nodes("", "", num_cpus=1, env={"PYTHONPATH": pythonpath(),
                                                                  "MINICPM_STARTUP_LOG": str(marks)}) as nodes:
        args = ["bulk", str(items), "--out", str(out), "--ray", nodes.address, "--replicas", "2", "--batch", "4",
                "--greedy", *MODEL]
        # (Ray Data starts its actors asynchronously and dispatches to the first one ready: on a loaded
        # machine the job could end before the other node's actor is up; here the pool waits for both)
        p = minicpm(*args, "-v", env=_env(**nodes.env, RAY_DATA_DEFAULT_WAIT_FOR_MIN_ACTORS_S="300"))
    err = p.stderr.decode()
    assert p.returncode == 0, err
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.suffix == ".wav"} == ref
    es = check_manifest(out, texts_by_id())
    assert all(e["seed"] is None and e["voice"] is None for e in es)
    ready = [json.loads(line) for line in marks.read_text().splitlines()]
    assert len({m["pid"] for m in ready if m.get("event") == "speaker_ready"}) == 2, ready  # two models, one per actor
    assert "minicpm: 40 items in" in err and "40 spoken" in err
    assert "Token authentication" not in err, err  # (Ray's notice: not ours to report)

    before = snapshot(out)
    t0 = time.monotonic()
    again = minicpm(*args)  # (the nodes are gone: a complete job joins no cluster)
    assert again.returncode == 0, again.stderr.decode()
    assert snapshot(out) == before  # every file, the manifest included: same bytes, not even rewritten
    assert again.stderr.decode().strip().splitlines()[-1] == f"minicpm: 40 items in {out}: all 40 already there"
    assert time.monotonic() - t0 < 30  # (nothing loaded, no cluster joined)


def test_a_killed_actor_is_replaced_and_every_item_gets_exactly_one_file(cluster, lines, tmp_path):
    """SIGKILL to one actor's process in the middle of the job: Ray restarts the actor, the batches
    it held run again, and the job ends with the 40 files and 40 manifest lines it would have had."""
    items, ref = lines
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "minicpm_cli", "bulk", str(items), "--out", str(out), "--ray", cluster,
         "--replicas", "2", "--batch", "2", "--greedy", "-v", *MODEL],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=ROOT)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(line.decode() for line in proc.stderr), daemon=True).start()

    def actors() -> list[int]:
        return list(dict.fromkeys(int(m) for line in err for m in re.findall(r"pid=(\d+)\).*minicpm: backend", line)))

    def done() -> int:
        try:
            return (out / bulk.MANIFEST).read_text().count("\n")
        except FileNotFoundError:
            return 0

    end = time.monotonic() + 240
    while (len(actors()) < 2 or done() < 6) and proc.poll() is None and time.monotonic() < end:
        time.sleep(0.05)
    assert proc.poll() is None and 6 <= done() < 30, ("".join(err), done())
    victim = actors()[0]
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=240) == 0, "".join(err)
    assert len(actors()) == 3 and victim in actors(), "".join(err)  # the killed one, its replacement, the other
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.suffix == ".wav"} == ref
    check_manifest(out, texts_by_id())


def test_seeds_are_derived_from_the_run_seed_and_the_id_wherever_items_run(cluster, tmp_path):
    """--seed 7: each item's seed is derive_seed(7, id) (an item's own seed wins), recorded in the
    manifest; its file is what `say --seed <that seed>` writes, here as FLAC, on two replicas."""
    src = tmp_path / "items.jsonl"
    rows = [{"id": "greeting", "text": "Say cat."}, {"text": "One."}, {"id": "own", "text": "Rock.", "seed": 5}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    p = minicpm("bulk", str(src), "--out", str(out), "--ray", cluster, "--replicas", "2", "--batch", "1",
                "--seed", "7", "--format", "flac", *MODEL)
    assert p.returncode == 0, p.stderr.decode()
    # the documented derivation, computed here independently of bulk.derive_seed
    derived = {i: int.from_bytes(hashlib.sha256(f"7:{i}".encode()).digest()[:8], "big") >> 1
               for i in ("greeting", "line-0002")}
    es = {e["id"]: e for e in check_manifest(out, {"greeting": "Say cat.", "line-0002": "One.", "own": "Rock."})}
    assert {i: e["seed"] for i, e in es.items()} == {**derived, "own": 5}
    assert {e["file"] for e in es.values()} == {"greeting.flac", "line-0002.flac", "own.flac"}
    for item_id, text, seed in (("greeting", "Say cat.", derived["greeting"]), ("own", "Rock.", 5)):
        alone = tmp_path / f"{item_id}-say.flac"
        p = minicpm("say", text, "--seed", str(seed), "-o", str(alone), *MODEL)
        assert p.returncode == 0, p.stderr.decode()
        assert (out / f"{item_id}.flac").read_bytes() == alone.read_bytes(), item_id


# -- bulk in this process, without Ray ------------------------------------------------------------------


def test_a_run_after_a_crash_redoes_what_was_lost_and_only_that(tmp_path):
    """Without --ray (and without Ray installed): a manifest line cut short, a file gone, a temporary
    file left by a killed run, an item whose text changed: those items are spoken again, the others
    are left alone, and the manifest ends as one whole line per item."""
    src = tmp_path / "items.txt"
    src.write_text("\n".join(TEXTS[:5]) + "\n")
    out = tmp_path / "out"
    run = ["bulk", str(src), "--out", str(out), "--greedy", *MODEL]
    p = minicpm(*run, prelude=BLOCK_RAY)
    assert p.returncode == 0, p.stderr.decode()
    first = {f.name: f.read_bytes() for f in out.iterdir()}
    manifest = out / bulk.MANIFEST
    lines = manifest.read_text().splitlines(keepends=True)
    by_id = {json.loads(line)["id"]: line for line in lines}
    # the crash: line-0005's line half written, line-0002's file gone, a temporary file of line-0003's
    manifest.write_text("".join(by_id[i] for i in ("line-0001", "line-0002", "line-0003", "line-0004"))
                        + by_id["line-0005"][:30])
    (out / "line-0002.wav").unlink()
    (out / ".line-0003.wav.x1y2z3.partial").write_bytes(b"RIFF")
    # and line 4 now says something else
    src.write_text("\n".join(TEXTS[:3] + ["Say salt.", TEXTS[4]]) + "\n")
    untouched = {n: (out / n).stat().st_mtime_ns for n in ("line-0001.wav", "line-0003.wav")}

    p = minicpm(*run, prelude=BLOCK_RAY)
    assert p.returncode == 0, p.stderr.decode()
    assert "3 spoken" in p.stderr.decode() and "2 already there" in p.stderr.decode(), p.stderr.decode()
    assert {n: (out / n).stat().st_mtime_ns for n in untouched} == untouched
    now = {f.name: f.read_bytes() for f in out.iterdir()}
    for name in ("line-0001.wav", "line-0002.wav", "line-0003.wav", "line-0005.wav"):
        assert now[name] == first[name], name
    assert now["line-0004.wav"] != first["line-0004.wav"]
    check_manifest(out, {**{f"line-{n:04d}": t for n, t in enumerate(TEXTS[:5], 1)}, "line-0004": "Say salt."})


def test_usage_errors_are_one_line_and_write_nothing(tmp_path):
    src = tmp_path / "items.txt"
    src.write_text("Hello.\n")
    out = tmp_path / "out"
    base = ["bulk", str(src), "--out", str(out)]
    one_line_error(minicpm(*base, "--replicas", "2"), "--replicas", "--ray", status=2)
    one_line_error(minicpm(*base, "--ray", str(src)), "--ray takes", status=2)
    one_line_error(minicpm(*base, "--ray", "auto", "--replicas", "3-1"), "--replicas takes N or MIN-MAX", status=2)
    one_line_error(minicpm(*base, "--greedy", "--seed", "1"), "--greedy takes no --seed", status=2)
    one_line_error(minicpm(*base, "--format", "mp3"), "--format", status=2)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "a", "text": "One."}\n{"id": "a", "text": "Two."}\n')
    one_line_error(minicpm("bulk", str(dup), "--out", str(out)), "item 2", "'a'", "item 1")
    voiced = tmp_path / "voiced.jsonl"
    voiced.write_text('{"text": "One.", "voice": "missing.wav"}\n')
    one_line_error(minicpm("bulk", str(voiced), "--out", str(out)), "missing.wav")
    # without the ray extra: one line that says what to install, for bulk and serve alike
    one_line_error(minicpm(*base, "--ray", "auto", prelude=BLOCK_RAY), "pip install 'minicpm-cli[ray]'")
    one_line_error(minicpm("serve", "--ray", "auto", prelude=BLOCK_RAY), "pip install 'minicpm-cli[ray]'")
    fifo = tmp_path / "fifo"  # (as /dev/stdin is: read once, nothing to read again when resuming)
    os.mkfifo(fifo)
    one_line_error(minicpm("bulk", str(fifo), "--out", str(out)), "is not a regular file", "save them to a file")
    # the model cannot be loaded: the directory this run made is not left behind, empty
    one_line_error(minicpm(*base, "--model", str(tmp_path / "nowhere"), prelude=BLOCK_RAY), "nowhere")
    assert not out.exists()
    out.mkdir()  # (one the user made stays)
    one_line_error(minicpm(*base, "--model", str(tmp_path / "nowhere"), prelude=BLOCK_RAY), "nowhere")
    assert out.is_dir() and not any(out.iterdir())


# -- reading items, seeds, the batch function --------------------------------------------------------


def test_items_from_text_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    txt = tmp_path / "a.txt"
    txt.write_text("First.\n\n   \nSecond.\n")
    items = bulk.plan(bulk.read_rows(txt), fmt="wav", greedy=True, seed=None, base=tmp_path)
    assert [(i.id, i.text, i.file, i.seed) for i in items] == [("line-0001", "First.", "line-0001.wav", None),
                                                               ("line-0002", "Second.", "line-0002.wav", None)]
    rows = [{"id": "x", "text": " Hi. ", "voice": "v/ref.wav", "seed": None},
            {"id": None, "text": "Two.", "voice": None, "seed": 3}, {"id": "7", "text": "Three.", "voice": "", "seed": None}]
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "ref.wav").write_bytes(b"")  # (a voice names a file that exists, as --voice's does)
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    parquet = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    csv_file = tmp_path / "a.csv"  # (as a spreadsheet saves it: a byte-order mark, CRLF, quotes, a blank line)
    csv_file.write_bytes("\ufeffid,text,voice,seed\r\nx,\" Hi. \",v/ref.wav,\r\n\r\n,Two.,,3\r\n7,Three.,,\r\n".encode())
    tsv = tmp_path / "a.tsv"
    tsv.write_text("seed\ttext\tid\tvoice\n\t Hi. \tx\tv/ref.wav\n3\tTwo.\t\t\n\tThree.\t7\t\n")
    for path in (jsonl, parquet, csv_file, tsv):
        got = bulk.plan(bulk.read_rows(path), fmt="flac", greedy=False, seed=11, base=tmp_path)
        assert [(i.id, i.text, i.file, i.seed, i.voice) for i in got] == [
            ("x", "Hi.", "x.flac", bulk.derive_seed(11, "x"), str(tmp_path / "v" / "ref.wav")),
            ("line-0002", "Two.", "line-0002.flac", 3, None),
            ("7", "Three.", "7.flac", bulk.derive_seed(11, "7"), None)], path
    assert bulk.plan([{"id": 7, "text": "Hi."}], fmt="wav", greedy=True, seed=None, base=tmp_path)[0].id == "7"
    # no --seed: one seed drawn for the run, each item's derived from it (and not pinned on resume)
    a, b = (bulk.plan(bulk.read_rows(txt), fmt="wav", greedy=False, seed=None, base=tmp_path) for _ in range(2))
    assert a[0].seed != b[0].seed and not a[0].seed_given and 0 <= a[0].seed < 2**63
    assert bulk.derive_seed(7, "line-0001") == int.from_bytes(hashlib.sha256(b"7:line-0001").digest()[:8], "big") >> 1


def test_a_table_without_a_text_column_or_with_a_bad_seed_is_refused(tmp_path):
    for name, content, message in [("a.csv", "id,words\nx,Hi.\n", "none is 'text' (it has: 'id', 'words')"),
                                   ("b.csv", "", "none is 'text' (it has: nothing)"),
                                   ("c.tsv", "text\tseed\nHi.\tseven\n", "line 2: seed 'seven' is not an integer"),
                                   ("d.csv", 'text\nOne.\n"Hi.\nTwo.\n',
                                    "the row from line 3: unexpected end of data (a quote not closed?)")]:
        path = tmp_path / name
        path.write_text(content)
        with pytest.raises(UsageError, match=re.escape(message)):
            bulk.read_rows(path)
    (tmp_path / "f.csv").write_text('text\n"Hi."x\n')  # (a quote closed, then more: no hint of an open one)
    with pytest.raises(UsageError, match=r"f\.csv, the row from line 2: ',' expected after '\"'$"):
        bulk.read_rows(tmp_path / "f.csv")
    (tmp_path / "e.csv").write_text('text\n"One, with a comma,\nand a line break"\n')
    assert bulk.read_rows(tmp_path / "e.csv") == [{"text": "One, with a comma,\nand a line break"}]


@pytest.mark.parametrize("row, error, message", [
    ({"text": ""}, UsageError, "item 1 has no text"),
    ({"id": "../x", "text": "Hi."}, UsageError, "cannot name a file"),
    ({"id": ".hidden", "text": "Hi."}, UsageError, "cannot name a file"),
    ({"text": "Hi.", "seed": "3"}, UsageError, "not an integer"),
    ({"text": "Hi.", "seed": 2**64}, UsageError, "seed must be between"),
    ({"text": "Hi.", "seed": 2.5}, UsageError, "not an integer"),
    # (json.loads gives "\ud800" as an unpaired surrogate: no tokenizer takes it, so the job is refused)
    ({"text": "Hi \ud800."}, UsageError, "item 1's text is not Unicode text: an unpaired surrogate, U+D800"),
    # (a file name holds 255 bytes: 101 two-byte letters are 202)
    ({"id": "é" * 101, "text": "Hi."}, UsageError, "at most 200 bytes in UTF-8"),
])
def test_bad_items_are_refused_naming_the_item(row, error, message, tmp_path):
    with pytest.raises(error, match=re.escape(message)):
        bulk.plan([row], fmt="wav", greedy=False, seed=1, base=tmp_path)


def test_ids_of_200_bytes_name_files(tmp_path):
    items = bulk.plan([{"id": "é" * 100, "text": "Hi."}, {"id": "a" * 200, "text": "Yo."}], fmt="flac",
                      greedy=True, seed=None, base=tmp_path)
    bulk.run(items, tmp_path, lambda pending: [bulk.Speaker(FakeSynth)(bulk._columns(pending))], progress=False,
             captions="srt")
    assert {e["file"] for e in entries(tmp_path)} == {"é" * 100 + ".flac", "a" * 200 + ".flac"}


def test_a_byte_order_mark_is_read_past_in_every_format_and_parquet_gaps_are_fields_not_given(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_bytes("\ufeffFirst.\nSecond.\n".encode())
    (tmp_path / "a.jsonl").write_bytes('\ufeff{"text": "First."}\n{"text": "Second."}\n'.encode())
    for name in ("a.txt", "a.jsonl"):
        items = bulk.plan(bulk.read_rows(tmp_path / name), fmt="wav", greedy=True, seed=None, base=tmp_path)
        assert [i.text for i in items] == ["First.", "Second."], name
    # as pandas writes a frame with gaps: a null id, a seed column of floats with a NaN
    pq.write_table(pa.table({"text": ["A.", "B."], "id": [None, "b"], "seed": [3.0, float("nan")]}),
                   tmp_path / "a.parquet")
    rows = bulk.read_rows(tmp_path / "a.parquet")
    assert rows == [{"text": "A.", "seed": 3.0}, {"text": "B.", "id": "b"}]
    items = bulk.plan(rows, fmt="wav", greedy=False, seed=11, base=tmp_path)
    assert [(i.id, i.seed) for i in items] == [("line-0001", 3), ("b", bulk.derive_seed(11, "b"))]


def test_a_saved_voice_replaced_between_runs_is_spoken_again(tmp_path):
    """Resuming compares the voice's samples, not only its path: `voice add NAME --force` between two
    runs makes that voice's items another voice's, and they are spoken again."""
    from minicpm_cli.voices.reference import Voice
    from minicpm_cli.voices.store import VoiceStore

    store = VoiceStore(tmp_path / "voices")
    store.add("anna", FIXTURES / "voice_ref_a.wav")
    rows = [{"id": "v", "text": "Hi.", "voice": "anna"}, {"id": "n", "text": "Yo."}]
    out = tmp_path / "out"
    out.mkdir()
    synth = FakeSynth()
    speaker = bulk.Speaker(lambda: synth)

    def run():
        items = bulk.check_voices(bulk.plan(rows, fmt="wav", greedy=True, seed=None, base=tmp_path, store=store))
        return bulk.run(items, out, lambda pending: [speaker(bulk._columns(pending))], progress=False)

    assert run().spoken == 2
    assert {e["id"]: e["voice_digest"] for e in entries(out)} == {"v": store.load("anna").digest, "n": None}
    assert run().skipped == 2
    samples, rate = sf.read(FIXTURES / "voice_ref_a.wav", dtype="float32")
    sf.write(tmp_path / "quieter.wav", samples * 0.5, rate)
    store.add("anna", tmp_path / "quieter.wav", force=True)
    again = run()
    assert (again.spoken, again.skipped) == (1, 1) and synth.calls[-1][0] == "Hi."
    assert entries(out)[-1]["voice_digest"] == Voice.load(tmp_path / "quieter.wav").digest


def test_voice_items_need_the_audio_encoder_before_anything_is_spoken(tmp_path):
    """A checkpoint without an audio encoder: one error before any item, not each voice item failing
    with advice to retry (a local directory is checked before loading; a model loaded from elsewhere
    when the Speaker starts)."""
    src = tmp_path / "items.jsonl"
    src.write_text(json.dumps({"text": "Hi.", "voice": str(FIXTURES / "voice_ref_a.wav")}) + "\n"
                   + json.dumps({"text": "Yo."}) + "\n")
    out = tmp_path / "out"
    one_line_error(minicpm("bulk", str(src), "--out", str(out), "--greedy", *MODEL, prelude=BLOCK_RAY),
                   "has no audio encoder (apm.* tensors)")
    assert not out.exists()

    class NoEncoder(FakeSynth):
        @property
        def voices(self):
            raise UsageError("voices need the checkpoint's audio encoder")

    with pytest.raises(UsageError, match="audio encoder"):
        bulk.Speaker(NoEncoder, voices=True)
    bulk.Speaker(NoEncoder)  # (no voice items: nothing asked of it)


def test_an_items_seed_with_greedy_is_a_conflict(tmp_path):
    with pytest.raises(OptionError, match="--greedy draws nothing"):
        bulk.plan([{"text": "Hi.", "seed": 3}], fmt="wav", greedy=True, seed=None, base=tmp_path)


def fake_audio(text: str, seed: int | None) -> np.ndarray:
    return np.full(240 * len(text), (sum(map(ord, text)) % 100) / 1000 + (seed or 0) % 7 / 10000, np.float32)


class FakeSynth:
    """say() returns samples that name the text and the seed; the text 'unreadable' fails as the
    tokenizer would; say_batch() is say() for each request, as the Synthesizer's is for one row.
    Records its calls."""

    sample_rate = 24000

    def __init__(self):
        self.calls: list[tuple] = []

    def say_batch(self, requests, *, speed=1.0, frames_per_token=None):
        return [self.say(text, sampling, voice=voice, speed=speed) for text, sampling, voice in requests]

    def say(self, text, sampling, *, voice=None, speed=1.0):
        from types import SimpleNamespace

        self.calls.append((text, sampling, voice, speed))
        if text == "unreadable":
            raise UsageError("the text has nothing the TTS tokenizer can read")
        return SimpleNamespace(audio=fake_audio(text, sampling.seed), sample_rate=24000, marks=((0, text),))


def test_the_speaker_maps_a_batch_through_one_function_and_fails_only_the_bad_item(monkeypatch):
    from minicpm_cli.engine.sampling import Sampling

    synth = FakeSynth()
    speaker = bulk.Speaker(lambda: synth)
    batches = []
    real = bulk.synthesize_batch
    monkeypatch.setattr(bulk, "synthesize_batch", lambda s, reqs, forced: batches.append(len(reqs)) or real(s, reqs, forced))
    ref = str(FIXTURES / "voice_ref_a.wav")
    items = [bulk.Item("a", "Hi.", "a.wav", 5, ref), bulk.Item("b", "Yo.", "b.wav", None)]
    out = speaker(bulk._columns(items))
    assert batches == [2]  # the batch in one call
    assert [c[:2] for c in synth.calls] == [("Hi.", Sampling(seed=5)), ("Yo.", Sampling(greedy=True))]
    assert synth.calls[0][2].name == ref and len(synth.calls[0][2].samples) and synth.calls[1][2] is None
    assert list(out["id"]) == ["a", "b"] and list(out["error"]) == ["", ""]
    for data, seconds, (text, seed) in zip(out["audio"], out["seconds"], [("Hi.", 5), ("Yo.", None)]):
        assert np.array_equal(np.frombuffer(data, "<f4"), fake_audio(text, seed))
        assert seconds == len(fake_audio(text, seed)) / 24000

    synth.calls.clear()
    batches.clear()
    items = [bulk.Item("a", "Hi.", "a.wav", None), bulk.Item("bad", "unreadable", "bad.wav", None),
             bulk.Item("c", "See.", "c.wav", None)]
    out = speaker(bulk._columns(items))
    assert batches == [3, 1, 1, 1]  # the batch failed: each item alone, to find which
    assert list(out["error"]) == ["", "the text has nothing the TTS tokenizer can read", ""]
    assert out["audio"][1] == b"" and len(out["audio"][0]) and len(out["audio"][2])


def test_a_job_runs_longest_text_first_in_the_same_batches_in_this_process_and_on_ray(tmp_path, monkeypatch):
    """bulk.batches: the items longest text first (ties in input order), --batch at a time; the
    in-process path speaks exactly those batches, in that order (Ray's blocks are cut from the same
    list: the byte-for-byte tests above hold across both)."""
    texts = ["Hi.", "A longer one.", "Yo.", "The longest text of all.", "Mid one.", "Ok."]
    items = bulk.plan([{"text": t} for t in texts], fmt="wav", greedy=True, seed=None, base=tmp_path)
    plan = bulk.batches(items, 4)
    assert [[i.text for i in group] for group in plan] == [
        ["The longest text of all.", "A longer one.", "Mid one.", "Hi."], ["Yo.", "Ok."]]
    synth = FakeSynth()
    spoken = []
    real = bulk.synthesize_batch
    monkeypatch.setattr(bulk, "synthesize_batch", lambda s, reqs, forced: spoken.append([r.text for r in reqs])
                        or real(s, reqs, forced))
    out = list(bulk.in_process(items, lambda: synth, 4))
    assert spoken == [[i.text for i in group] for group in plan]
    assert [list(o["id"]) for o in out] == [[i.id for i in group] for group in plan]


def test_bulk_random_weights_forces_the_lengths(tmp_path, monkeypatch):
    """`bulk --random-weights` (tiny sizes here): the model drawn, no checkpoint read; each item's
    length forced (say_batch's frames_per_token), its file the one the same read alone gives."""
    from typer.testing import CliRunner

    from minicpm_cli.cli.app import app
    from minicpm_cli.engine import loading
    from minicpm_cli.engine.pipeline import Synthesizer
    from minicpm_cli.engine.sampling import Sampling
    from minicpm_cli.engine.synthetic import SyntheticSpec

    monkeypatch.setattr(SyntheticSpec, "full", SyntheticSpec.tiny)
    monkeypatch.setattr(loading, "FORCED_FRAMES_PER_TOKEN", 2)
    src = tmp_path / "items.txt"
    src.write_text("Say cat.\nOne more text here.\nGo.\n")
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["bulk", str(src), "--out", str(out), "--random-weights", "--device", "cpu",
                                 "--backend", "eager", "--batch", "2", "--greedy"])
    assert r.exit_code == 0, r.output
    synth = Synthesizer.load(None, random_weights=True, spec=SyntheticSpec.tiny(), device="cpu", backend="eager")
    for e in entries(out):
        alone = synth.say_batch([(e["text"], Sampling(greedy=True), None)], frames_per_token=2)[0]
        assert len(alone.codes) == 2 * len(synth.tokenizers.encode_bert(e["text"])), e
        assert e["seconds"] == pytest.approx(len(alone.audio) / 24000, abs=1e-4), e


def test_bulk_speed_reaches_the_model_and_the_manifest(tmp_path):
    """--speed: every item's request carries it (one say_batch at that speed), the manifest records
    it, and a run at another speed speaks the items again rather than taking the old files."""
    synth = FakeSynth()
    speaker = bulk.Speaker(lambda: synth)
    items = bulk.plan([{"text": "Hi."}, {"text": "Yo."}], fmt="wav", greedy=True, seed=None, base=tmp_path, speed=1.5)
    assert [i.speed for i in items] == [1.5, 1.5]
    bulk.run(items, tmp_path, lambda pending: [speaker(bulk._columns(pending))], progress=False)
    assert [c[3] for c in synth.calls] == [1.5, 1.5]
    assert [e["speed"] for e in entries(tmp_path)] == [1.5, 1.5]
    again = bulk.run(items, tmp_path, lambda pending: [speaker(bulk._columns(pending))], progress=False)
    assert again.skipped == 2 and len(synth.calls) == 2
    slower = bulk.plan([{"text": "Hi."}, {"text": "Yo."}], fmt="wav", greedy=True, seed=None, base=tmp_path)
    redone = bulk.run(slower, tmp_path, lambda pending: [speaker(bulk._columns(pending))], progress=False)
    assert redone.spoken == 2 and [c[3] for c in synth.calls[2:]] == [1.0, 1.0]


def test_run_writes_what_arrives_shows_progress_and_leaves_failed_items_for_the_next_run(tmp_path, capsys):
    """bulk.run over results that arrive out of order, one item failing: the others get their files and
    lines as they arrive, a tqdm bar counts items and audio seconds per second; the failed item gets
    neither, and the next run asks for it alone."""
    items = [bulk.Item(f"i{n}", f"Text {n}.", f"i{n}.wav", n) for n in range(5)]

    def results(fail: set[str]):
        def produce(pending):
            asked.append([i.id for i in pending])
            for group in (pending[3:], pending[:3]):  # (a later batch first, as a pool may finish them)
                cols = bulk._columns(group)
                audio = np.empty(len(group), dtype=object)
                audio[:] = [b"" if i.id in fail else fake_audio(i.text, i.seed).tobytes() for i in group]
                yield {"id": cols["id"], "audio": audio,
                       "seconds": np.array([0.0 if i.id in fail else len(fake_audio(i.text, i.seed)) / 24000 for i in group]),
                       "marks": np.array(["[]" if i.id in fail else json.dumps([[0, i.text]]) for i in group], dtype=object),
                       "error": np.array(["nothing readable" if i.id in fail else "" for i in group], dtype=object)}
        return produce

    asked: list[list[str]] = []
    summary = bulk.run(items, tmp_path, results({"i1"}), progress=True)
    assert (summary.spoken, summary.skipped, summary.failed) == (4, 0, [("i1", "nothing readable")])
    assert summary.seconds == pytest.approx(sum(len(fake_audio(i.text, i.seed)) for i in items if i.id != "i1") / 24000)
    err = capsys.readouterr().err
    assert "speaking" in err and "5/5" in err and "s audio/s" in err, err
    assert [e["id"] for e in entries(tmp_path)] == ["i3", "i4", "i0", "i2"]  # (in the order they arrived)
    assert not (tmp_path / "i1.wav").exists()
    for e in entries(tmp_path):
        got, rate = sf.read(tmp_path / e["file"], dtype="int16")
        item = next(i for i in items if i.id == e["id"])
        assert rate == 24000 and np.array_equal(got, np.round(fake_audio(item.text, item.seed) * 32767).astype(np.int16))
    summary = bulk.run(items, tmp_path, results(set()), progress=False)
    assert asked[-1] == ["i1"] and (summary.spoken, summary.skipped, summary.failed) == (1, 4, [])
    check_manifest(tmp_path, {i.id: i.text for i in items})


def test_serve_args_and_deployment_options(monkeypatch):
    """Serve's options follow the replica's rows: at most `batch` requests on a replica (the rest wait
    in Serve's router for the first free row), autoscaling aimed at half of them; the compiled-kernel
    cache variables set here reach the replicas."""
    from minicpm_cli.scale import ray_serve

    monkeypatch.setenv("MINICPM_API_KEY", "from-env")  # (read by each replica, not put into Serve's config)
    for name in bulk.CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    args = ray_serve.ServeArgs.from_args({"model": "/m", "replicas": "2-6", "device": "cuda", "batch": "16"})
    assert (args.model, args.api_key, args.num_gpus, args.batch) == ("/m", None, 1, 16)
    opts = ray_serve.deployment_options(args)
    assert opts["autoscaling_config"] == {"min_replicas": 2, "initial_replicas": 2, "max_replicas": 6,
                                          "target_ongoing_requests": 8.0}
    assert "num_replicas" not in opts and opts["ray_actor_options"] == {"num_gpus": 1}
    assert opts["max_ongoing_requests"] == 32  # (its 16 rows, and 16 queued to refill them)
    # (serve's --batch 0: each replica as many rows as fit, at most MAX_ROWS)
    assert ray_serve.deployment_options(ray_serve.ServeArgs())["max_ongoing_requests"] == 2 * memory.MAX_ROWS
    monkeypatch.setenv("TRITON_CACHE_DIR", "/shared/triton")
    fixed = ray_serve.deployment_options(ray_serve.ServeArgs.from_args(
        {"replicas": 3, "device": "cpu", "api_key": "k", "max_ongoing_requests": "2", "target_ongoing_requests": 1}))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed and fixed["max_ongoing_requests"] == 2
    assert fixed["ray_actor_options"] == {"num_gpus": 0, "runtime_env": {"env_vars": {"TRITON_CACHE_DIR": "/shared/triton"}}}
    assert ray_serve.ServeArgs.from_args({"gpus": "0.5"}).num_gpus == 0.5
    with pytest.raises(OptionError, match="unknown option.*modle"):
        ray_serve.ServeArgs.from_args({"modle": "x"})
    with pytest.raises(OptionError, match="replicas"):
        ray_serve.ServeArgs.from_args({"replicas": "4-2"})


def test_replicas_that_cannot_start_are_one_line():
    """What Serve reports of a failed deployment becomes our error's one line (the replica's own error
    where it raised one of ours: `serve --ray --model /no/such/dir` says the directory is not found)."""
    from minicpm_cli.scale import ray_serve
    from minicpm_cli.errors import MinicpmError

    report = ("Deploying application minicpm failed: Failed to update the deployments ['Speech'].\n"
              "The deployment failed to start 3 times in a row.\nTraceback (most recent call last):\n"
              "  File \"/x/checkpoint.py\", line 40, in resolve\n"
              "minicpm_cli.errors.ModelNotFound: model directory not found: /no/such/dir\n")
    e = ray_serve._failure(report)
    assert isinstance(e, MinicpmError) and str(e) == "model directory not found: /no/such/dir"
    e = ray_serve._failure("Deploying application minicpm failed: out of resources\nmore detail\n")
    assert str(e) == "the replicas did not start: Deploying application minicpm failed: out of resources"


# -- KubeRay manifests ------------------------------------------------------------------------------


def _ray_cluster_spec(spec: dict, where: str) -> None:
    """What KubeRay v1 requires of a RayCluster spec, and GPUs on the workers."""
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict), where  # (required by ray.io/v1)
    groups = spec["workerGroupSpecs"]
    assert groups, where
    for pod in [head["template"]] + [g["template"] for g in groups]:
        containers = pod["spec"]["containers"]
        assert containers and all(c["image"] and c["name"] for c in containers), where
    for g in groups:
        assert g["groupName"] and isinstance(g["rayStartParams"], dict), where
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], where
        assert all(int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1 for c in g["template"]["spec"]["containers"]), where


def test_the_kuberay_manifests_are_what_kuberay_and_our_commands_accept():
    """docs/kuberay/: the RayJob's entrypoint is a `minicpm bulk` whose options exist; the
    RayService's serveConfigV2 names our application builder, which imports and accepts its args;
    both carry the fields KubeRay v1 requires. docs/scale-out.md points at both files."""
    import importlib
    import shlex

    import typer.main
    import yaml

    from minicpm_cli.cli.app import app
    from minicpm_cli.scale import ray_serve

    docs = ROOT / "docs"
    job = yaml.safe_load((docs / "kuberay" / "bulk-rayjob.yaml").read_text())
    service = yaml.safe_load((docs / "kuberay" / "serve-rayservice.yaml").read_text())
    guide = (docs / "scale-out.md").read_text()
    for doc, kind in ((job, "RayJob"), (service, "RayService")):
        assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", kind) and doc["metadata"]["name"]
    assert "kuberay/bulk-rayjob.yaml" in guide and "kuberay/serve-rayservice.yaml" in guide

    words = shlex.split(job["spec"]["entrypoint"])
    assert words[:2] == ["minicpm", "bulk"]
    bulk_cmd = typer.main.get_command(app).commands["bulk"]
    known = {o for p in bulk_cmd.params for o in p.opts}
    assert {w for w in words if w.startswith("--")} <= known, words
    _ray_cluster_spec(job["spec"]["rayClusterSpec"], "RayJob")

    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    for application in config["applications"]:
        module, _, attr = application["import_path"].partition(":")
        assert getattr(importlib.import_module(module), attr) is ray_serve.app
        assert application["route_prefix"].startswith("/")
        ray_serve.ServeArgs.from_args(application["args"])  # (an unknown key or a bad value raises)
    _ray_cluster_spec(service["spec"]["rayClusterConfig"], "RayService")


# -- Ray Serve --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def streams(lines, tmp_path_factory):
    """What `say -o -` streams for each text the Serve tests ask for (one `say --lines -o -` over them,
    cut where each text's audio ends: a streamed and a whole-file read have the same length)."""
    _, ref = lines
    texts = TEXTS[:4] + [LONG]
    src = tmp_path_factory.mktemp("streams") / "texts.txt"
    src.write_text("\n".join(texts) + "\n")
    p = minicpm("say", "--lines", "--greedy", "-o", "-", "-f", str(src), *MODEL)
    assert p.returncode == 0, p.stderr.decode()
    head, body = p.stdout[:44], p.stdout[44:]
    out, at = {}, 0
    for n, text in enumerate(texts[:4], 1):
        size = len(ref[f"line-{n:04d}.wav"]) - 44
        out[text], at = head + body[at : at + size], at + size
    out[LONG] = head + body[at:]
    assert len(out[LONG]) > 44 + 24000 * 2 * 5  # (more than 5 s of audio)
    return out


@pytest.fixture(scope="module")
def on_serve(cluster):
    """`minicpm serve --ray` with 2 replicas and an API key; its stderr lines as they come."""
    import socket

    if openai is None:
        pytest.skip("the openai client (the test extra) is not installed")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "minicpm_cli", "serve", "--ray", cluster, "--replicas", "2",
                             "--port", str(port), "--api-key", KEY, *MODEL], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=ROOT)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(line.decode() for line in proc.stderr), daemon=True).start()
    end = time.monotonic() + 300
    while not any(line.startswith("minicpm: serving ") for line in lines):
        assert proc.poll() is None and time.monotonic() < end, "".join(lines)
        time.sleep(0.1)
    proc.lines, proc.url = lines, f"http://127.0.0.1:{port}"
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


def client(url: str, key: str = KEY):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)


def speak(url: str, text: str, stream: bool) -> bytes:
    c = client(url)
    if not stream:
        return c.audio.speech.create(model="tts-1", voice="default", input=text, response_format="wav",
                                     extra_body={"greedy": True}).content
    with c.audio.speech.with_streaming_response.create(model="tts-1", voice="default", input=text,
                                                       response_format="wav", stream_format="audio",
                                                       extra_body={"greedy": True}) as r:
        assert r.status_code == 200
        return b"".join(r.iter_bytes())


def test_serve_on_ray_answers_eight_concurrent_openai_requests_with_says_bytes(on_serve, lines, streams, tmp_path):
    _, ref = lines
    ready = [line for line in on_serve.lines if line.startswith("minicpm: serving ")]
    assert ready == [f"minicpm: serving {TINY} (eager, cpu) at {on_serve.url} on Ray Serve (2 replicas, 0 GPUs each)\n"]
    jobs = [(n, stream) for n in range(1, 5) for stream in (False, True)]
    results: dict = {}
    barrier = threading.Barrier(len(jobs))

    def ask(job):
        n, stream = job
        barrier.wait()
        results[job] = speak(on_serve.url, TEXTS[n - 1], stream)

    threads = [threading.Thread(target=ask, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(results) == sorted(jobs)
    for (n, stream), data in results.items():
        assert data == (streams[TEXTS[n - 1]] if stream else ref[f"line-{n:04d}.wav"]), (n, stream)
    # the key holds behind Serve's proxy; `say --server` (the thin client) works through it too
    with pytest.raises(openai.AuthenticationError):
        client(on_serve.url, "wrong").audio.speech.create(model="tts-1", voice="default", input="Hi.")
    out = tmp_path / "x.wav"
    p = minicpm("say", TEXTS[0], "--greedy", "-o", str(out), "--server", on_serve.url, env=_env(MINICPM_API_KEY=KEY))
    assert p.returncode == 0, p.stderr.decode()
    assert out.read_bytes() == ref["line-0001.wav"]


def test_a_replica_killed_under_load_fails_its_requests_loudly_and_later_ones_succeed(on_serve, lines, streams):
    """Six long streams over two replicas; once audio flows, one replica is killed. Each stream either
    ends whole, with `say`'s bytes, or fails with an error: none ends early as if it were complete.
    Then new requests, streamed and whole, get their bytes."""
    import ray

    _, ref = lines
    results: dict[int, object] = {}
    started = threading.Semaphore(0)

    def ask(i: int):
        try:
            c = client(on_serve.url)
            with c.audio.speech.with_streaming_response.create(model="tts-1", voice="default", input=LONG,
                                                               response_format="wav", stream_format="audio",
                                                               extra_body={"greedy": True}) as r:
                parts = []
                for part in r.iter_bytes():
                    if not parts:
                        started.release()
                    parts.append(part)
            results[i] = b"".join(parts)
        except Exception as e:  # (what the client raises is the point: kept and checked below)
            started.release()
            results[i] = e

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for _ in range(2):  # (two streams flowing: both replicas are generating)
        assert started.acquire(timeout=300)
    replicas = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["name"].startswith("SERVE_REPLICA::minicpm#"))
    assert len(replicas) == 2, replicas
    ray.kill(ray.get_actor(replicas[0], namespace="serve"), no_restart=True)
    for t in threads:
        t.join(timeout=300)
    failed = [r for r in results.values() if isinstance(r, Exception)]
    whole = [r for r in results.values() if not isinstance(r, Exception)]
    assert len(results) == 6 and failed, results
    assert all(r == streams[LONG] for r in whole), [len(r) for r in whole]
    # queued on the replica that died: Serve's 500 (the openai client's default retries resend it);
    # streaming from it: the chunked body breaks off, which the client's HTTP library raises
    for e in failed:
        assert (isinstance(e, openai.APIStatusError) and e.status_code >= 500) \
            or isinstance(e, openai.APIConnectionError) or "incomplete chunked read" in str(e), repr(e)
    assert speak(on_serve.url, TEXTS[1], stream=True) == streams[TEXTS[1]]
    assert speak(on_serve.url, TEXTS[2], stream=False) == ref["line-0003.wav"]


def test_sigterm_deletes_the_application(on_serve, cluster):
    from ray import serve

    on_serve.send_signal(signal.SIGTERM)
    assert on_serve.wait(timeout=180) == 0, "".join(on_serve.lines)
    assert not [line for line in on_serve.lines if "SIGTERM handler is not set" in line or "Token authentication"
                in line], "".join(on_serve.lines)
    assert "minicpm" not in serve.status().applications
