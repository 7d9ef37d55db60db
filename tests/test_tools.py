"""Every script in tools/ answers `--help` without a GPU: it imports (its imports still resolve after a
move) and builds its argument parser. Nothing else of a tool runs: most need CUDA and a full-size
model."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import pythonpath

ROOT = Path(__file__).resolve().parents[1]
TOOLS = sorted(p.name for p in (ROOT / "tools").glob("*.py"))


def _help(name: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (as a user runs it)
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, on a GPU machine too
    env["PYTHONPATH"] = pythonpath()
    return subprocess.run([sys.executable, str(ROOT / "tools" / name), "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def helps(request):
    """The selected tools' `--help`, run side by side (each is mostly Python importing torch):
    name -> a future of its completed process."""
    names = sorted({item.callspec.params["tool"] for item in request.session.items
                    if getattr(item, "originalname", None) == "test_tool_help" and hasattr(item, "callspec")})
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        yield {name: pool.submit(_help, name) for name in names}


def test_there_are_tools():
    assert len(TOOLS) >= 10, TOOLS


@pytest.mark.parametrize("tool", TOOLS)
def test_tool_help(tool, helps):
    p = helps[tool].result()
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith(f"usage: {tool}"), p.stdout[:500]
    assert "--help" in p.stdout
