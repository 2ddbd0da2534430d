"""The package's layers, read from its imports (docs/architecture.md): arrows run one way.

Every module of kombu_pgjobs sits in one layer of :data:`LAYERS`. The import graph is read with
``ast`` from the source (nothing is imported), and three rules are held:

* **no wrong-way import**: a module imports its own layer or a lower one. Every import counts
  here: at module level, inside a function, and under ``if TYPE_CHECKING:`` (a type named from a
  higher layer is still knowledge of it). kombu_pgjobs never imports celery_ext.
* **no circle** between modules, over the imports that run: module level and function level.
  An ``if TYPE_CHECKING:`` import never runs and is not counted for circles (the broker's loop
  names its channel's type, the channel holds the loop).
* **no private name of another module**: ``from .x import _name`` fails (a helper that two
  modules use gets a public name, in the lower of the two or in a common module). A private
  *module* (``from . import _alias``) is not a name.

A new module is placed in LAYERS when it is added: an unplaced module fails the test.
"""

from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = "kombu_pgjobs"

#: (layer, modules: a name or a package prefix), lowest first. A layer may import itself and
#: the layers above it in this list; never one below.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("ground", ("kombu_pgjobs.errors", "kombu_pgjobs.events", "kombu_pgjobs.options",
                "kombu_pgjobs.url", "kombu_pgjobs.shardmap", "kombu_pgjobs.green",
                "kombu_pgjobs.limits", "kombu_pgjobs.recurrence")),
    ("store", ("kombu_pgjobs.store",)),
    ("broker", ("kombu_pgjobs.broker",)),
    ("ops", ("kombu_pgjobs.ops",)),
    # the package's entries: its __init__, the .pth hook, the pytest plugin, and the shims that
    # keep documented import paths (each is the module it names: sys.modules)
    ("entry", ("kombu_pgjobs", "kombu_pgjobs._alias", "kombu_pgjobs.pytest",
               "kombu_pgjobs.embedded", "kombu_pgjobs.dashboard", "kombu_pgjobs.outbox",
               "kombu_pgjobs.core", "kombu_pgjobs.prometheus")),
]
#: documented import path -> the module it is
SHIMS = {
    "kombu_pgjobs.embedded": "kombu_pgjobs.store.embedded",
    "kombu_pgjobs.dashboard": "kombu_pgjobs.ops.dashboard",
    "kombu_pgjobs.outbox": "kombu_pgjobs.broker.outbox",
    "kombu_pgjobs.core": "kombu_pgjobs.store.core",
    "kombu_pgjobs.prometheus": "kombu_pgjobs.ops.prometheus",
}


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    names: tuple[str, ...]
    kind: str  # "top", "function", "type"
    line: int

    def __str__(self) -> str:
        what = f" ({', '.join(self.names)})" if self.names else ""
        return f"{self.src}:{self.line} -> {self.dst}{what} [{self.kind}]"


def modules(root: Path, pkg: str) -> dict[str, Path]:
    out = {}
    for p in sorted((root / pkg).rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _kinds(tree: ast.AST) -> dict[int, str]:
    """id(node) -> "type" under ``if TYPE_CHECKING:``, "function" inside a def."""
    kinds: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if inner is not node:
                    kinds.setdefault(id(inner), "function")
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                for inner in ast.walk(stmt):
                    kinds[id(inner)] = "type"
    return kinds


def edges(root: Path, pkg: str) -> list[Edge]:
    mods = modules(root, pkg)
    out = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        kinds = _kinds(tree)
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            kind = kinds.get(id(node), "top")
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in (pkg, "celery_ext"):
                        out.append(Edge(mod, a.name, (), kind, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] not in (pkg, "celery_ext"):
                    continue
                plain = []
                for a in node.names:
                    if f"{target}.{a.name}" in mods:  # a submodule
                        out.append(Edge(mod, f"{target}.{a.name}", (), kind, node.lineno))
                    else:
                        plain.append(a.name)
                if plain:
                    out.append(Edge(mod, target, tuple(plain), kind, node.lineno))
    return out


def layer_of(mod: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, rank)
    for rank, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            hit = mod == prefix or (prefix != PKG and mod.startswith(prefix + "."))
            if hit and (best is None or len(prefix) > best[0]):
                best = (len(prefix), rank)
    return None if best is None else best[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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
            if len(comp) > 1 or v in graph.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def runtime_graph(all_edges: list[Edge], mods: set[str]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for e in all_edges:
        if e.kind != "type" and e.dst in mods and e.dst != e.src:
            graph.setdefault(e.src, set()).add(e.dst)
    return graph


def wrong_way(all_edges: list[Edge], layers: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    bad = []
    for e in all_edges:
        if e.dst.split(".")[0] == "celery_ext":
            bad.append(f"{e}: kombu_pgjobs never imports celery_ext")
            continue
        src, dst = layer_of(e.src, layers), layer_of(e.dst, layers)
        if src is not None and dst is not None and dst > src:
            bad.append(f"{e}: {layers[src][0]} may not import {layers[dst][0]}")
    return bad


def private_names(all_edges: list[Edge]) -> list[str]:
    return [f"{e}: imports {n}, private to {e.dst}" for e in all_edges
            for n in e.names if n.startswith("_") and not n.startswith("__") and e.dst != e.src]


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in modules(ROOT, PKG) if layer_of(m) is None]
    assert not unplaced, f"place these modules in LAYERS (tests/test_layout.py): {unplaced}"


def test_no_import_runs_up_a_layer() -> None:
    bad = wrong_way(edges(ROOT, PKG), LAYERS)
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(bad)


def test_no_circle() -> None:
    all_edges = edges(ROOT, PKG)
    mods = set(modules(ROOT, PKG))
    found = cycles(runtime_graph(all_edges, mods))
    detail = []
    for comp in found:
        detail.append(" <-> ".join(comp))
        detail += [f"    {e}" for e in all_edges
                   if e.src in comp and e.dst in comp and e.kind != "type"]
    assert not found, "modules that import each other:\n" + "\n".join(detail)


def test_no_private_name_of_another_module() -> None:
    bad = private_names(edges(ROOT, PKG))
    assert not bad, "give these a public name (or a common home):\n" + "\n".join(bad)


def test_each_wing_says_what_it_may_import() -> None:
    for wing in ("store", "broker", "ops", "ops/cli"):
        doc = ast.get_docstring(ast.parse((ROOT / PKG / wing / "__init__.py").read_text()))
        assert doc and "May import" in doc, f"{PKG}/{wing}/__init__.py: say what lives there " \
                                            "and what it may import"


@pytest.mark.parametrize("documented", sorted(SHIMS))
def test_documented_paths_are_the_modules(documented: str) -> None:
    assert importlib.import_module(documented) is importlib.import_module(SHIMS[documented])


def test_the_checks_catch_what_they_forbid(tmp_path: Path) -> None:
    """A planted circle, wrong-way import and private name are each found (the rules can fail)."""
    pkg = tmp_path / PKG
    for sub in ("store", "broker"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "store" / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "if TYPE_CHECKING:\n    from ..broker.c import Loop\n")
    (pkg / "store" / "b.py").write_text("def f():\n    from .a import _helper\n")
    (pkg / "broker" / "c.py").write_text("from ..store.a import thing\n")
    found = edges(tmp_path, PKG)
    assert cycles(runtime_graph(found, set(modules(tmp_path, PKG)))) == [
        ["kombu_pgjobs.store.a", "kombu_pgjobs.store.b"]]
    assert [w.split(":")[0] for w in wrong_way(found, LAYERS)] == ["kombu_pgjobs.store.a"]
    assert len(private_names(found)) == 1
