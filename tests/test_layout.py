"""The house rules that a reorganisation could break: one import namespace in the installed
distribution, imports that go one way (backends build on the model code, never the reverse), and a
version that the command reports."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minicpm_cli"
# The composition layer: the modules that put a backend together with the model code (and the CLI
# over them). Every other module of minicpm_cli is model code and must not import the backends.
COMPOSERS = {"pipeline", "cli", "bench"}


def test_wheel_installs_one_namespace(tmp_path):
    """Build the wheel from a copy of the tree: its top-level names are minicpm_cli and its metadata,
    with the backends (and the CUDA source they compile) inside minicpm_cli."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("minicpm_cli", "backends"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    out = tmp_path / "dist"
    out.mkdir()
    code = "import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))"
    p = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    wheel = out / p.stdout.strip().splitlines()[-1]
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"minicpm_cli"}, sorted(top)
    assert "minicpm_cli/backends/__init__.py" in names
    assert "minicpm_cli/backends/q4_decode.cu" in names
    assert "minicpm_cli/backends/kernels/decode.py" in names
    assert "minicpm_cli/data/tiny-tokenizers/tokenizer.json" in names  # bundled for --random-weights
    assert not any(n.startswith("backends/") for n in names)


def _imports(path: Path, package: str) -> set[str]:
    """Absolute names of the modules `path` (a module of `package`) imports, relative ones resolved."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


def test_model_code_does_not_import_the_backends():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        if rel.parts[0] in COMPOSERS:
            continue
        package = ".".join(("minicpm_cli",) + rel.parts[:-1])  # a module's package (an __init__'s: itself)
        bad = {m for m in _imports(path, package)
               if m == "backends" or m.startswith("backends.") or m.startswith("minicpm_cli.backends")}
        if bad:
            offenders.append(f"{path.relative_to(ROOT)}: {sorted(bad)}")
    assert not offenders, offenders


def test_the_checker_sees_an_import_of_the_backends(tmp_path):
    """The rule above is only as good as `_imports`: it must resolve relative and absolute forms."""
    f = tmp_path / "m.py"
    f.write_text("from . import backends\nfrom .backends.gptq import quantize\nimport minicpm_cli.backends\n")
    found = _imports(f, "minicpm_cli")
    assert {"minicpm_cli.backends", "minicpm_cli.backends.gptq", "minicpm_cli.backends"} <= found


def test_version_is_the_distributions():
    from importlib.metadata import version

    p = subprocess.run([sys.executable, "-m", "minicpm_cli", "--version"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"minicpm {version('minicpm-cli')}"
