"""minicpm: text to speech with MiniCPM-o 2.6, faithful to the reference implementation.

Python API (the CLI is a thin layer over it)::

    from minicpm_cli import Synthesizer, Sampling
    synth = Synthesizer.load("openbmb/MiniCPM-o-2_6")          # or a local directory
    utt = synth.say("Hello world.", Sampling(greedy=True))     # utt.audio: float32 at 24 kHz

Importing the package is cheap: torch is loaded on first use of these names.
"""

__version__ = "0.1.0"
__all__ = ["Synthesizer", "Sampling", "Utterance"]


def __getattr__(name: str):
    if name in ("Synthesizer", "Utterance"):
        from . import pipeline

        return getattr(pipeline, name)
    if name == "Sampling":
        from .sampling import Sampling

        return Sampling
    raise AttributeError(name)
