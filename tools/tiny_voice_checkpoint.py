"""Put the tiny voice checkpoint together in a directory, to try `--voice` on the bundled tiny model:

    python tools/tiny_voice_checkpoint.py OUT_DIR [--copy]
    minicpm say "Hi." --model OUT_DIR --voice tests/fixtures/voice_ref_a.wav -o v.wav

The repository keeps one copy of the weights the two tiny checkpoints share:
tests/fixtures/tiny-minicpmo is the base checkpoint, and tests/fixtures/tiny-minicpmo-voice-extra
holds only what the voice checkpoint adds to it (the audio encoder's tensors, `audio.safetensors`,
and the voice checkpoint's `config.json`). `assemble` combines the two in the official sharded
layout: the two safetensors files as two shards of one index, the voice config, and everything else
from the base. The files are symbolic links into the checkout (nothing is copied, so OUT_DIR works
only while the checkout stays where it is) unless `--copy`. The tests' `voice_dir` fixture
(tests/conftest.py) is this function.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
BASE = FIXTURES / "tiny-minicpmo"
EXTRA = FIXTURES / "tiny-minicpmo-voice-extra"
# What the voice checkpoint takes from the base besides its weights.
FROM_BASE = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "preprocessor_config.json",
             "assets")


def assemble(out: Path, base: Path = BASE, extra: Path = EXTRA, copy: bool = False) -> Path:
    """Write the voice checkpoint (base plus extra) into `out`, a new or empty directory, and return
    it: links to the files (copies with `copy`) and the index of the two shards."""
    from safetensors import safe_open

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    shards = {"model-00001-of-00002.safetensors": base / "model.safetensors",
              "model-00002-of-00002.safetensors": extra / "audio.safetensors"}
    files = {name: base / name for name in FROM_BASE}
    files.update(shards)
    files["config.json"] = extra / "config.json"
    for name, source in files.items():
        if not copy:
            (out / name).symlink_to(source.resolve(), target_is_directory=source.is_dir())
        elif source.is_dir():
            shutil.copytree(source, out / name)
        else:
            shutil.copy2(source, out / name)
    weight_map = {}
    for name, path in shards.items():
        with safe_open(path, framework="pt") as f:
            weight_map.update(dict.fromkeys(f.keys(), name))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="a new or empty directory")
    ap.add_argument("--copy", action="store_true", help="copy the files instead of linking them")
    args = ap.parse_args()
    try:
        out = assemble(args.out, copy=args.copy)
    except FileExistsError as e:
        sys.exit(f"tiny_voice_checkpoint: {e}")
    print(f"wrote {out}: the tiny checkpoint with an audio encoder (--model {out} --voice FILE)", file=sys.stderr)


if __name__ == "__main__":
    main()
