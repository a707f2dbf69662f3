"""Imports go down, never up: the supervisor's front end (omnid/supervisor/http/) imports nothing of
the stage workers' code (omnid/worker/), and the rest of the supervisor only what is listed here (its
handles that start a worker process or a Ray actor), so that no new one comes in unseen.

What both sides share lives in a neutral room below them (the job folder's stream files:
omnid/paths.py). Read from the source (ast): imports inside functions and under TYPE_CHECKING count.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SUPERVISOR = ROOT / "omnid" / "supervisor"
# What is left to move (issue 44: no import from omnid/worker/ into omnid/supervisor/): a worker's
# entry point and the Ray actor's class and words, which these handles start and speak to.
STILL_ALLOWED = {
    "omnid/supervisor/workers/worker_process.py": {"omnid.worker.bootstrap"},
    "omnid/supervisor/workers/ray_stage.py": {"omnid.worker.ray_actor", "omnid.worker.outputs"},
}


def worker_imports(source: str, module: str) -> set[str]:
    """The omnid.worker modules `source` (the module `module`) imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = module.split(".")[:-node.level] if node.level else []
            name = ".".join([*base, node.module] if node.module else base)
            names = [name, *(f"{name}.{alias.name}" for alias in node.names)] if node.level else [name]
        else:
            continue
        found |= {n for n in names if n == "omnid.worker" or n.startswith("omnid.worker.")}
    return found


def _modules(folder: Path) -> dict[str, set[str]]:
    out = {}
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(ROOT)
        out[str(rel)] = worker_imports(path.read_text(), ".".join(rel.with_suffix("").parts))
    return out


def test_the_finder_sees_every_form_of_import() -> None:
    assert worker_imports("from omnid.worker.outputs import stream_file", "omnid.supervisor.http.x") == \
        {"omnid.worker.outputs"}
    assert worker_imports("def f():\n    import omnid.worker.main as m\n", "omnid.supervisor.x") == {"omnid.worker.main"}
    assert worker_imports("from ...worker import outputs", "omnid.supervisor.http.x") == \
        {"omnid.worker", "omnid.worker.outputs"}
    assert worker_imports("from omnid.workers import x\nfrom omnid.supervisor.workers import y", "omnid.x") == set()


def test_the_front_end_imports_nothing_of_the_workers() -> None:
    found = {path: names for path, names in _modules(SUPERVISOR / "http").items() if names}
    assert found == {}, found


def test_the_rest_of_the_supervisor_only_what_is_listed() -> None:
    found = {path: names for path, names in _modules(SUPERVISOR).items() if names}
    assert found == STILL_ALLOWED, "a new import of omnid/worker/ (or one the list no longer needs): " \
                                   f"{found}"
