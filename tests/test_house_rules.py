"""Rules of the source tree that keep it readable, checked from the source with `ast`.

- No import cycle between the files of strata/, nor between its packages (a package is a folder:
  strata.mtp and strata.mtp.train are two; a module directly in strata/ counts as its own), counting every import, also those inside functions:
  a function-level import hides a cycle from the interpreter, not from a reader.
- No file of strata/ over MAX_LINES lines: past that a module does more than one job.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "strata"
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _is_package(mods: dict[str, Path], name: str) -> bool:
    return mods[name].name == "__init__.py"


def import_graph() -> dict[str, set[str]]:
    """module -> the strata modules it imports (from a.b import c names a.b.c when that is a module)."""
    mods = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{path}: relative import (the graph is read from absolute ones)")
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                if t in mods and t != name and not (_is_package(mods, t) and name.startswith(t + ".")):
                    edges[name].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    nodes = set(edges) | {t for ts in edges.values() for t in ts}
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def _package_of(mods: dict[str, Path], name: str) -> str:
    """A module's folder; a module directly in strata/ (errors, protocol, defaults) stands alone,
    so that the bottom modules every package reads do not join strata/ to all of them."""
    if _is_package(mods, name):
        return name
    folder = name.rpartition(".")[0]
    return name if folder == "strata" else folder


def test_cycles_are_found_by_the_checker():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_files():
    edges = import_graph()
    bad = cycles(edges)
    detail = "; ".join(" <-> ".join(c) for c in bad)
    assert not bad, f"import cycles between files: {detail}"


def test_no_import_cycle_between_packages():
    mods = _modules()
    pkg_edges: dict[str, set[str]] = defaultdict(set)
    why: dict[tuple[str, str], str] = {}
    for a, targets in import_graph().items():
        for b in targets:
            pa, pb = _package_of(mods, a), _package_of(mods, b)
            if pa != pb:
                pkg_edges[pa].add(pb)
                why.setdefault((pa, pb), f"{a} -> {b}")
    bad = cycles(pkg_edges)
    lines = []
    for comp in bad:
        members = set(comp)
        lines.append(", ".join(why[(x, y)] for x in comp for y in sorted(pkg_edges[x]) if y in members))
    assert not bad, "import cycles between packages: " + " | ".join(lines)


def test_no_file_over_the_line_limit():
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"
