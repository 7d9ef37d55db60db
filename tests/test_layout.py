"""The house rules that a reorganisation could break: one import namespace in the installed
distribution, imports that go one way (backends build on the model code, never the reverse), and a
version that the command reports."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import pythonpath

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minicpm_cli"
BACKENDS = ROOT / "backends"

# The house: which part may import which (docs/design.md, and each folder's __init__ docstring). The
# shared leaves (errors, trace, protocol, audio, captions) import nothing of ours but each other.
LEAVES = {"errors", "trace", "protocol", "files", "audio", "captions"}
MAY_IMPORT = {
    "leaves": {"leaves"},
    "models": {"models"},
    "voices": {"voices", "leaves"},
    "backends": {"backends", "models", "engine", "leaves"},
    "engine": {"engine", "models", "voices", "backends", "leaves"},
    "serving": {"serving", "engine", "models", "voices", "backends", "leaves"},
    "scale": {"scale", "serving", "engine", "models", "voices", "backends", "leaves"},
    "cli": {"cli", "scale", "serving", "engine", "models", "voices", "backends", "leaves"},
    "package": {"engine"},  # minicpm_cli/__init__.py: the public API's lazy names
    "__main__": {"cli"},  # python -m minicpm_cli
}
# The engine's modules that put a backend together with the rest; every other engine module is model
# code and must not import the backends (a backend wraps or transforms the model, never the reverse).
COMPOSERS = {"minicpm_cli.engine.pipeline", "minicpm_cli.engine.loading"}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the installed namespace: name -> (file, is a package)."""
    found = {}
    for base, prefix in ((PACKAGE, ("minicpm_cli",)), (BACKENDS, ("minicpm_cli", "backends"))):
        for path in sorted(base.rglob("*.py")):
            parts = prefix + path.relative_to(base).with_suffix("").parts
            is_pkg = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return found


def _part(module: str) -> str:
    """The part of the house a module belongs to (a MAY_IMPORT key)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "package"
    if parts[1] in LEAVES:
        return "leaves"
    return parts[1]


def _imports_of(path: Path, module: str, is_pkg: bool, modules) -> dict[str, set[str]]:
    """The modules of ours that `module` imports (anywhere in it, lazily too) -> the names it takes
    from each ('' for the module itself)."""
    package = module if is_pkg else module.rsplit(".", 1)[0]
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    found.setdefault(a.name, set()).add("")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                if f"{mod}.{a.name}" in modules:
                    found.setdefault(f"{mod}.{a.name}", set()).add("")
                elif mod in modules:
                    found.setdefault(mod, set()).add(a.name)
    return found


def _graph():
    modules = _modules()
    return {m: _imports_of(p, m, pkg, modules) for m, (p, pkg) in modules.items()}


def _cycles(graph: dict[str, dict]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), and self-imports."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _edges(graph):
    """module -> the modules it imports, a package's __init__ not counted as imported by its own
    modules (`from . import x` names the sibling x, which _imports_of already resolves)."""
    return {m: {t for t in ts if not (m.startswith(t + ".") and t != "minicpm_cli")} for m, ts in graph.items()}


def test_no_import_cycles():
    cycles = _cycles(_edges(_graph()))
    assert not cycles, cycles


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_parts_import_only_what_they_may():
    offenders = []
    for module, targets in _graph().items():
        part = _part(module)
        for target in targets:
            if target == "minicpm_cli" and module != "minicpm_cli":
                continue  # (the package itself: its __version__)
            if _part(target) not in MAY_IMPORT[part] and target != module:
                offenders.append(f"{module} -> {target}")
    assert not offenders, offenders


def test_no_private_names_across_modules():
    """Nothing takes a private name (`_x`) from another module of ours, in the package and in tools/."""
    modules = _modules()
    offenders = []
    for module, targets in _graph().items():
        for target, names in targets.items():
            offenders += [f"{module}: {target}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
    for path in sorted((ROOT / "tools").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("minicpm_cli"):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        offenders.append(f"{path.name}: {node.module}.{a.name}")
                    if f"{node.module}.{a.name}" in modules:
                        aliases.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                aliases |= {a.asname for a in node.names if a.name.startswith("minicpm_cli") and a.asname}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                offenders.append(f"{path.name}: {node.value.id}.{node.attr}")
    assert not offenders, offenders


def test_model_code_does_not_import_the_backends():
    offenders = []
    for module, targets in _graph().items():
        if _part(module) in ("engine", "models", "voices") and module not in COMPOSERS:
            bad = sorted(t for t in targets if t.startswith("minicpm_cli.backends"))
            if bad:
                offenders.append(f"{module}: {bad}")
    assert not offenders, offenders


def test_the_graph_resolves_relative_and_absolute_imports(tmp_path):
    """The rules above are only as good as `_imports_of`: it must resolve both forms, lazy ones too."""
    f = tmp_path / "m.py"
    f.write_text("from .. import backends\nfrom ..backends.gptq import _q\nimport minicpm_cli.errors\n"
                 "def f():\n    from ..serving import client\n")
    modules = _modules()
    found = _imports_of(f, "minicpm_cli.engine.m", False, modules)
    assert found["minicpm_cli.backends"] == {""}
    assert found["minicpm_cli.backends.gptq"] == {"_q"}
    assert "minicpm_cli.errors" in found and "minicpm_cli.serving.client" in found


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
    assert {"minicpm_cli/backends/q4_decode.cu", "minicpm_cli/backends/q4_chain.cu"} <= set(names)
    assert "minicpm_cli/backends/kernels/decode.py" in names
    assert "minicpm_cli/data/tiny-tokenizers/tokenizer.json" in names  # bundled for --random-weights
    assert not any(n.startswith("backends/") for n in names)
    # every module of the tree is in the wheel (a package left out of pyproject's list would be missing
    # from `pip install .` while the editable install of the tests still found it)
    modules = {"/".join(m.split(".")) + ("/__init__.py" if is_pkg else ".py") for m, (_, is_pkg) in _modules().items()}
    assert modules - set(names) == set(), sorted(modules - set(names))


def test_version_is_the_distributions():
    from importlib.metadata import version

    p = subprocess.run([sys.executable, "-m", "minicpm_cli", "--version"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": pythonpath()})
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"minicpm {version('minicpm-cli')}"


def test_a_source_checkout_runs_without_installing(tmp_path):
    """`python -m minicpm_cli` in a checkout that was never installed: minicpm_cli.backends, which an
    install maps from the top-level backends/ folder, resolves there too (the package's __init__)."""
    src = tmp_path / "checkout"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("minicpm_cli", "backends"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    code = ("import sys\n"  # (no install: drop the finders an editable install of this repository adds)
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in str(getattr(f, '__module__', '')).lower()]\n"
            "sys.path_hooks[:] = [h for h in sys.path_hooks if 'editable' not in getattr(h, '__module__', '').lower()]\n"
            "sys.path.insert(0, sys.argv[1])\n"
            "import minicpm_cli.backends as b, minicpm_cli.backends.kernels\n"
            "print(b.__file__)\n"
            "sys.argv = ['minicpm', '--version']\n"
            "from minicpm_cli.cli.app import main\nmain()\n")
    p = subprocess.run([sys.executable, "-c", code, str(src)], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0] == str(src / "backends" / "__init__.py"), p.stdout
    assert p.stdout.splitlines()[1].startswith("minicpm ")
