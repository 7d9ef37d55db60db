"""Shared fixtures: the tiny checkpoint in the official layout and the reference goldens."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (read when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

FIXTURES = Path(__file__).parent / "fixtures"
TINY = FIXTURES / "tiny-minicpmo"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def goldens():
    return np.load(FIXTURES / "goldens.npz")


@pytest.fixture(scope="session")
def manifest():
    return json.loads((FIXTURES / "manifest.json").read_text())


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return TINY


@pytest.fixture(scope="session")
def codec():
    """The tiny checkpoint's DVAE decoder (bf16 in the file, upcast) and Vocos, float32 on the CPU."""
    from safetensors import safe_open

    from minicpm_cli.codec import Codec

    prefix = "tts.dvae."
    with safe_open(TINY / "model.safetensors", framework="pt") as f:
        dvae = {k[len(prefix):]: f.get_tensor(k).float() for k in f.keys() if k.startswith(prefix)}
    vocos = torch.load(TINY / "assets" / "Vocos.pt", map_location="cpu", weights_only=True)
    return Codec.from_tensors(dvae, vocos, "cpu")
