#!/usr/bin/env bash
# The runs behind docs/benchmarks.md's tables on one GPU, each backend, workload and stream count in a
# process of its own (the tables' method), full-size random weights. Rows go to stdout as markdown,
# each run's JSON to $OUT (default: a new folder under /tmp), its stderr beside it.
#
#   tools/bench_tables.sh PART...
#     head      compile and int4: read and reply, two processes each (the table takes the second:
#               Triton's cache warm)
#     eager     read and reply (one run: host-bound, about 100 s a process)
#     gguf      a random Q4_K_M made on the GPU (export and llama.cpp's quantizer, 70-90 s), then read
#               and reply (needs llama-cpp-python built with CUDA)
#     many      compile and int4 at NS streams (default "16 64 128"): read, reply, bulk
#     tests     the GPU tests of alone against batched (test_invariant.py, test_batching.py)
#
# Env: NS (stream counts), BACKENDS (for many; default "compile int4"), T (seconds a process, 200).
# On the project's GPU machine, source .device/setup.sh first (shared/device/README.md).
set -u
OUT=${OUT:-$(mktemp -d /tmp/bench-tables.XXXX)}
mkdir -p "$OUT"
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
echo "runs in $OUT" >&2
run() {  # run TAG ARGS...: one bench process; its table rows on stdout
  local tag=$1; shift
  echo "=== $tag"
  timeout "${T:-200}" "$py" -m minicpm_cli bench --random-weights "$@" --json "$OUT/$tag.json" \
    2>"$OUT/$tag.err" | grep -E '^\| [a-z0-9]+ \|' | grep -v '^| backend ' || echo "(no row: see $OUT/$tag.err)"
}
for part in "$@"; do
  case "$part" in
  head)
    for be in compile int4; do for w in read reply; do for p in 1 2; do
      run "head-$be-$w-$p" -b "$be" --workload "$w" --runs 3 --warmup 1
    done; done; done ;;
  eager)
    for w in read reply; do run "head-eager-$w" -b eager --workload "$w" --runs 1 --warmup 1; done ;;
  gguf)
    gguf=$OUT/llm-q4_k_m.gguf
    "$py" - "$gguf" <<'PY' || continue
import os, sys, time
from minicpm_cli.engine import gguf_export
from minicpm_cli.engine.pipeline import BUNDLED_TOKENIZERS
from minicpm_cli.engine.synthetic import RandomCheckpoint, SyntheticSpec
t0, dst = time.time(), sys.argv[1]
ck = RandomCheckpoint(SyntheticSpec.full(), seed=0)
f16 = dst + ".f16"
gguf_export.from_checkpoint(ck, ck.config, BUNDLED_TOKENIZERS / "tokenizer.json", f16, ftype="F16", device="cuda")
gguf_export.quantize(f16, dst, "Q4_K_M")
os.remove(f16)
print(f"Q4_K_M {os.path.getsize(dst) / 1e9:.2f} GB in {time.time() - t0:.0f} s", file=sys.stderr)
PY
    for w in read reply; do run "head-gguf-$w" -b gguf --gguf "$gguf" --workload "$w" --runs 3 --warmup 1; done ;;
  many)
    for be in ${BACKENDS:-compile int4}; do for n in ${NS:-16 64 128}; do for w in read reply bulk; do
      r=2; [ "$w" = bulk ] && r=1
      run "many-$be-$w-$n" -b "$be" --workload "$w" --concurrency "$n" --runs "$r" --warmup 1
    done; done; done ;;
  tests)
    timeout "${T:-300}" "$py" -m pytest -q -m gpu -p no:cacheprovider tests/test_invariant.py tests/test_batching.py \
      2>&1 | tail -15 ;;
  *) echo "unknown part '$part' (head, eager, gguf, many, tests)" >&2; exit 2 ;;
  esac
done
