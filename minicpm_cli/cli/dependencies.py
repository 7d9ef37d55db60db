"""Which installed package an import needs, for the one-line error of a broken installation.

A package minicpm-cli depends on can go missing from a user's Python after it was installed (removed
by hand, another tool's `pip uninstall`, a half-finished upgrade). The first command that needs it
then fails on its import; instead of a traceback the CLI names the package and the pip command that
puts it back. Only the packages of pyproject.toml count (tests/test_usage_errors.py keeps this table
and the file's dependencies in step), and only when the package itself cannot be found: a submodule
missing from an installed package, or a module of ours, is a bug and keeps its traceback.
Standard library only: entry.py imports this before typer.
"""

from __future__ import annotations

import importlib.util

# import name -> (distribution on PyPI, minicpm-cli's extra that brings it, or None: a core dependency)
PACKAGES = {
    "torch": ("torch", None), "transformers": ("transformers", None), "tokenizers": ("tokenizers", None),
    "safetensors": ("safetensors", None), "huggingface_hub": ("huggingface_hub", None), "typer": ("typer", None),
    "numpy": ("numpy", None), "soundfile": ("soundfile", None), "soxr": ("soxr", None), "tqdm": ("tqdm", None),
    "fastapi": ("fastapi", None), "uvicorn": ("uvicorn", None), "websockets": ("websockets", None),
    "greenlet": ("greenlet", None), "python_multipart": ("python-multipart", None),
    "llama_cpp": ("llama-cpp-python", "gguf"), "gguf": ("gguf", "gguf"), "ray": ("ray", "ray"),
}


def missing(error: ModuleNotFoundError) -> str | None:
    """The one-line message for `error` where it is one of our packages gone from this Python, else None."""
    top = (error.name or "").split(".")[0]
    if top not in PACKAGES or error.name != top:
        return None
    try:
        if importlib.util.find_spec(top) is not None:  # (there after all: something inside it is wrong)
            return None
    except (ImportError, ValueError):
        pass
    dist, extra = PACKAGES[top]
    fix = f"pip install 'minicpm-cli[{extra}]'" if extra else "pip install --force-reinstall minicpm-cli"
    return f"cannot import '{top}': the package {dist}, which minicpm-cli needs, is not installed in this Python ({fix})"
