"""Write a full-size MiniCPM-o 2.6 checkpoint with random weights in the official layout (bf16, five
shards and an index, like openbmb/MiniCPM-o-2_6's speech tensors), and optionally its GPTQ int4
conversion (the layout of openbmb/MiniCPM-o-2_6-int4), for measuring loading and cold starts where
the real weights cannot be downloaded (`minicpm bench --startup --model DIR`). `--audio` adds the
audio encoder (Whisper-medium's, with the projection; shards of its own) that voices load. Drawn and
quantized on the GPU when there is one.

    python tools/write_full_checkpoint.py OUT_DIR [--audio] [--gptq OUT_INT4_DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minicpm_cli.backends.gptq import write_gptq_checkpoint  # noqa: E402
from minicpm_cli.engine.synthetic import SyntheticSpec, write_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--gptq", default=None, help="also write the GPTQ int4 conversion here")
    ap.add_argument("--shard-gb", type=float, default=3.5)
    ap.add_argument("--audio", action="store_true", help="include the audio encoder (for --voice)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = time.perf_counter()
    write_checkpoint(args.out, SyntheticSpec.full(), tokenizer_from=ROOT / "tests" / "fixtures" / "tiny-minicpmo",
                     device=device, max_shard_bytes=int(args.shard_gb * 1e9), include_audio=args.audio)
    print(f"wrote {args.out} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    if args.gptq:
        t = time.perf_counter()
        write_gptq_checkpoint(args.out, args.gptq, device=device)
        print(f"wrote {args.gptq} in {time.perf_counter() - t:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
