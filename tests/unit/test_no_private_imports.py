"""No module of omnid or omnictl imports another's private name (`from omnid.x import _name`): what
two modules share is named as shared (issue 44). Read from the source (ast), imports anywhere."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def private_imports(source: str) -> list[str]:
    """`module._name` for each private name `source` imports from omnid or omnictl."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in {"omnid", "omnictl"}):
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_the_reader_sees_a_private_import() -> None:
    assert private_imports("from omnid.tracing import SpanMaker, _Quiet\nimport os\n") == ["omnid.tracing._Quiet"]
    assert private_imports("def f():\n    from omnid.a import _b\n") == ["omnid.a._b"]
    assert private_imports("from os import _exit\n") == []


def test_no_module_imports_another_s_private_name() -> None:
    found = {str(p.relative_to(ROOT)): names for p in [*(ROOT / "omnid").rglob("*.py"), *(ROOT / "omnictl").rglob("*.py")]
             if (names := private_imports(p.read_text()))}
    assert found == {}, found
