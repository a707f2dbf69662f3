"""The config parser's tools: a `Problem` (one error, at its key path), `ConfigError` (all of them),
and `Checker`, which reads untrusted TOML values and collects every problem instead of stopping at
the first; with the small value helpers the tables share (type names, paths, `module:function`
references).

Standard library only; the tables' parsers (daemon.py, stages.py, pipelines.py) build on it.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One configuration error, located by its key path."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class ConfigError(Exception):
    """The configuration is invalid; `problems` lists every reason."""

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s)\n{lines}")


class Checker:
    """Collects problems while reading untrusted TOML data."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def add(self, path: str, message: str) -> None:
        self.problems.append(Problem(path, message))

    def table(self, data: Any, path: str) -> dict[str, Any]:
        if not isinstance(data, dict):
            self.add(path, f"must be a table, not {typename(data)}")
            return {}
        return data

    def unknown(self, data: Mapping[str, Any], allowed: Iterable[str], path: str) -> None:
        allowed = set(allowed)
        for key in data:
            if key not in allowed:
                self.add(f"{path}.{key}" if path else key,
                         f"unknown key (known: {', '.join(sorted(allowed))})")

    def get(self, data: Mapping[str, Any], key: str, path: str, kind: type | tuple[type, ...],
            default: Any = None, *, required: bool = False) -> Any:
        full = f"{path}.{key}" if path else key
        if key not in data:
            if required:
                self.add(full, "is required")
            return default
        value = data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # bool is an int in Python; a TOML `true` is never a valid number here.
        if isinstance(value, bool) and bool not in kinds:
            self.add(full, f"must be {_kindname(kinds)}, not a boolean")
            return default
        if not isinstance(value, kinds):
            self.add(full, f"must be {_kindname(kinds)}, not {typename(value)}")
            return default
        return value


def typename(value: Any) -> str:
    return {dict: "a table", list: "an array", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _kindname(kinds: tuple[type, ...]) -> str:
    names = {dict: "a table", list: "an array", str: "a string", bool: "a boolean",
             int: "an integer", float: "a number"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def resolve_path(base: Path, value: str) -> Path:
    p = Path(os.path.expandvars(os.path.expanduser(value)))
    return p if p.is_absolute() else (base / p)


def check_callable_ref(c: Checker, ref: str, path: str, python_path: tuple[Path, ...]) -> None:
    """`package.module:function`: check the form, and that the module can be found."""
    module, sep, func = ref.partition(":")
    if not sep or not module or not func or not func.isidentifier() or \
            not all(part.isidentifier() for part in module.split(".")):
        c.add(path, f"must be \"package.module:function\", not {ref!r}")
        return
    saved = list(sys.path)
    sys.path[:0] = [str(p) for p in python_path]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        sys.path[:] = saved
    if not found:
        c.add(path, f"module {module!r} cannot be found{_searched(python_path)}")


PRODUCED_KINDS = ("text", "image", "audio", "tensor", "json", "file")     # an output's kind (worker/outputs.py)


def declared_produces(ref: str, python_path: tuple[Path, ...]) -> tuple[str, ...] | None:
    """What a python stage's `package.module:name` says it produces, read from its module's source
    without importing it (no torch in the supervisor): `name.produces = (...)` at the module's top
    level (a function), or `produces = (...)` in `class name:` (a class); a literal of kind names.
    None when it says nothing (or the module cannot be read)."""
    module, _, name = ref.partition(":")
    saved = list(sys.path)
    sys.path[:0] = [str(p) for p in python_path]
    try:
        spec = importlib.util.find_spec(module)
        source = Path(spec.origin).read_text() if spec is not None and spec.origin else None
        tree = ast.parse(source) if source is not None else None
    except (ImportError, ValueError, OSError, SyntaxError):
        return None
    finally:
        sys.path[:] = saved
    for node in tree.body if tree is not None else []:
        in_class = isinstance(node, ast.ClassDef) and node.name == name
        for stmt in node.body if in_class and isinstance(node, ast.ClassDef) else [node]:
            if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
                continue
            target = stmt.targets[0]
            if (in_class and isinstance(target, ast.Name) and target.id == "produces") or (
                    isinstance(target, ast.Attribute) and target.attr == "produces"
                    and isinstance(target.value, ast.Name) and target.value.id == name):
                try:
                    value = ast.literal_eval(stmt.value)
                except ValueError:
                    return None
                return tuple(value) if isinstance(value, (list, tuple)) else (value,)
    return None


def _searched(python_path: tuple[Path, ...]) -> str:
    """Where an import looked, for the message: python_path's folders (as resolved, relative ones from
    the config file's folder; a missing one marked), then sys.path."""
    if not python_path:
        return " on sys.path (python_path is empty; its folders are relative to the config file's folder)"
    folders = ", ".join(str(p) if p.is_dir() else f"{p} (no such folder)" for p in python_path)
    return f" in python_path ({folders}; relative folders are from the config file's folder) nor on sys.path"
