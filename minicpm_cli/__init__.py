"""minicpm: text to speech with MiniCPM-o 2.6, faithful to the reference implementation.

Python API (the CLI is a thin layer over it)::

    from minicpm_cli import Synthesizer, Sampling
    synth = Synthesizer.load("openbmb/MiniCPM-o-2_6")          # or a local directory
    utt = synth.say("Hello world.", Sampling(greedy=True))     # utt.audio: float32 at 24 kHz

Importing the package is cheap: torch is loaded on first use of these names.

The house (docs/design.md has the map): `engine/` speaks, `models/` holds the networks, `voices/`
reads and keeps reference recordings, `serving/` is the server and its client, `scale/` is bulk
work and Ray, `cli/` is the command line; `errors`, `trace`, `protocol` and `audio` are leaves that
every part may import. The backends (the repository's `backends/` folder) install as
`minicpm_cli.backends`.
"""

import os as _os

# A source checkout run without installing (`python -m minicpm_cli` in the repository): the backends
# sit in the repository's top-level backends/ folder, which an install maps to minicpm_cli.backends.
# Let the package's submodule search see the repository root so that the same name resolves there.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "backends")) and _os.path.isfile(
        _os.path.join(_root, "backends", "__init__.py")):
    __path__.append(_root)

__version__ = "0.1.0"
__all__ = ["Synthesizer", "Sampling", "Utterance"]


def __getattr__(name: str):
    if name in ("Synthesizer", "Utterance"):
        from .engine import pipeline

        return getattr(pipeline, name)
    if name == "Sampling":
        from .engine.sampling import Sampling

        return Sampling
    raise AttributeError(name)
