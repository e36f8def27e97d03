"""The layers: the simulator (``envs/``) and the policy server (``serving/``) import neither the
training package ``agents``, RLlib nor torch, not even through a module path in a string.
Read from the source, so that a path the tests never run is caught too: every import
statement; every string naming a module of ``agents`` outside docstrings (an executor named
``"agents.x:Y"``); every string a call imports (``importlib.import_module("torch")``).
Other strings are no import: ``envs/quiet.py`` names RLlib's and torch's loggers to silence
them, which loads nothing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: what each layer must not import (top-level package names)
FORBIDDEN = ("agents", "ray", "torch")
#: a module path in a string: ``agents``, ``agents.online``, ``agents.online:Cls``
_PATH = re.compile(r"^(\w+)([.:][A-Za-z_][\w.]*(:\w+)?)?$")
#: the calls that import the module named by their first argument
_IMPORTERS = ("import_module", "__import__", "find_spec", "load_executor", "executor_class")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are docstrings (of the module, classes,
    functions) or bare string statements (attribute docs): prose, not code."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for stmt in body:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) \
                        and isinstance(stmt.value.value, str):
                    out.add(id(stmt.value))
    return out


def _imported_strings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that a call imports (its first argument)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in _IMPORTERS and isinstance(node.args[0], ast.Constant):
                out.add(id(node.args[0]))
    return out


def _module_path(value: str, imported: bool) -> bool:
    m = _PATH.match(value.strip())
    if m is None or m.group(1) not in FORBIDDEN:
        return False
    return imported or (m.group(1) == "agents" and m.group(2) is not None)


def violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    docs, imported = _docstrings(tree), _imported_strings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else []
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docs
              and _module_path(node.value, id(node) in imported)):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: string {node.value!r}")
            continue
        else:
            continue
        for n in names:
            if n.split(".")[0] in FORBIDDEN:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: import {n}")
    return found


@pytest.mark.parametrize("layer", ["envs", "serving", "reporting"])
def test_a_layer_imports_no_training_package(layer):
    files = sorted((ROOT / layer).rglob("*.py"))
    assert files
    bad = [v for f in files for v in violations(f)]
    assert not bad, "\n".join(bad)


def test_the_check_sees_imports_and_paths_in_strings(tmp_path):
    """The check itself: each way of reaching the agents is found, prose is not."""
    f = ROOT / "envs" / "_layering_probe.py"
    f.write_text('"""Uses :mod:`agents.online` (prose)."""\n'
                 "import importlib\n"
                 "from agents.online import OnlineGreedy\n"
                 "import torch.nn\n"
                 "X = importlib.import_module('agents.online')\n"
                 "EXECUTOR = 'agents.online:OnlineGreedy'\n"
                 "Y = importlib.import_module('torch')\n"
                 "OK = 'agents are processes'\n"
                 "LOGGER = 'torch.onnx._internal'  # a logger's name: loads nothing\n")
    try:
        got = violations(f)
    finally:
        f.unlink()
    assert len(got) == 5, got
    assert any("import agents.online" in g for g in got)
    assert any("import torch.nn" in g for g in got)
    assert sum("string" in g for g in got) == 3
    assert not any("onnx" in g for g in got)


def _serving_modules() -> dict[str, Path]:
    """Every module under ``serving/``, subpackages included, by dotted name (``serving.app``,
    ``serving.bundles.static``; a package by its ``__init__``)."""
    out = {}
    for p in (ROOT / "serving").rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _serving_imports(path: Path) -> set[str]:
    """The ``serving`` modules (dotted names) a module imports, anywhere in it (inside
    functions too), but not under ``if TYPE_CHECKING:`` (no import at run time). ``from X
    import y`` names ``X.y`` and ``X`` (a module or a name in ``X``: the caller keeps those
    that exist)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = list(parts[:-1])  # a module's package; a package's __init__ is in its own
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m == "serving" or m.startswith("serving.")}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_under_serving():
    """No module of ``serving/`` imports, even inside a function, one that imports it back
    (the bundles' format, signing and loaders included)."""
    mods = _serving_modules()
    assert {"serving.app", "serving.bundles.static", "serving.bundles.format"} <= set(mods)
    graph = {m: {d for d in _serving_imports(p) if d in mods and d != m}
             for m, p in mods.items()}
    assert graph["serving.bundles.static"] >= {"serving.bundles.format",
                                               "serving.bundles.signing"}
    assert _cycles(graph) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
