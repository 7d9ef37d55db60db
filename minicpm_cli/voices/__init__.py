"""Voices: reference recordings in (any soundfile format to checked 16 kHz mono float32), the store of
saved voices, and what a `--voice` / `voice` value names.

No torch: `say` through a server resolves a voice here and sends its samples. May import only the
shared leaves (`errors`, `protocol`).
"""
