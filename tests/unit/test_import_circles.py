"""No import circles in omnid and omnictl: no module reaches itself through the modules it imports.

Read from the source (ast), with every import statement counted: at the top, under TYPE_CHECKING, and
inside functions. (Not the parent packages Python imports before a module: a package's __init__ that
re-exports its own modules is its face, not a circle.) A circle through type-only or deferred imports does not fail at run time, but it still
ties its modules into one room that cannot be read, tested or moved alone (the socket API's handlers
and the OpenAPI document were one such room of 12 modules until they took `ApiCore` from core.py
instead of `Api` from app.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules(root: Path = ROOT) -> dict[str, str]:
    """Dotted name -> source, for every module of omnid and omnictl (a package by its __init__)."""
    out = {}
    for top in ("omnid", "omnictl"):
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text()
    return out


def imports(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of `sources` it imports, anywhere in it (`from pkg import mod` names mod)."""
    graph: dict[str, set[str]] = {m: set() for m in sources}
    for module, source in sources.items():
        package = module.split(".")                 # (what a relative import starts from)
        if not any(other.startswith(module + ".") for other in sources):
            package = package[:-1]
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                name = ".".join([*base, node.module] if node.module else base)
                names = [f"{name}.{a.name}" if f"{name}.{a.name}" in sources else name for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in sources:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    graph[module].add(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_the_finder_sees_a_circle_through_type_only_and_relative_imports() -> None:
    sources = {
        "p": "",
        "p.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.b import B\n",
        "p.b": "from .c import C\n",
        "p.c": "def f():\n    from p import a\n",
        "p.d": "import p.a\n",
    }
    assert circles(imports(sources)) == [["p.a", "p.b", "p.c"]]
    sources["p.c"] = "import os\n"
    assert circles(imports(sources)) == []


def test_omnid_and_omnictl_have_no_import_circle() -> None:
    graph = imports(modules())
    assert len(graph) > 100          # (the walk found the code)
    assert circles(graph) == []
