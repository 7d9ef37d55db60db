"""The speech engine: text in, audio chunks out, on one model in this process.

Owns the pipeline (`Synthesizer`, the Python API), the LLM and TTS runners, the reference's
streaming state machine, many streams at once (`batching`), the codec, sampling, tokenizers and
prompts, checkpoints (reading them, and writing synthetic ones), tensor I/O, and a voice's turn in
the LLM context (`cloning`, `features`).

May import: `minicpm_cli.models`, `minicpm_cli.voices` (a reference's samples), the shared leaves
(`errors`, `trace`, `protocol`, `audio`), and, from `pipeline` and `loading` alone (they put a
backend together with the rest), the backends. Never the command line, serving or scale-out: they
build on the engine.
"""
