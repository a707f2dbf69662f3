"""Imports go down, never up: the supervisor (its front end, omnid/supervisor/http/, and the rest) and
omnictl import nothing of the stage workers' code (omnid/worker/) (issue 44).

What both sides share lives in a neutral room below them: the job folder's stream files
(omnid/paths.py) and private files (omnid/job_files.py), the messages (omnid/protocol.py, a Ray
actor's words too); the supervisor starts a worker by omnid/stage_entry.py's two entry points, which
import the worker when called. Read from the source (ast): imports inside functions and under
TYPE_CHECKING count; and checked in a fresh interpreter, where the daemon's modules load none of it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SUPERVISOR = ROOT / "omnid" / "supervisor"


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


def test_the_rest_of_the_supervisor_and_omnictl_import_nothing_of_the_workers() -> None:
    found = {path: names for folder in (SUPERVISOR, ROOT / "omnictl") for path, names in _modules(folder).items()
             if names}
    assert found == {}, found


def test_the_daemon_s_modules_load_without_the_worker() -> None:
    code = ("import sys, omnid.cli, omnid.supervisor.daemon, omnid.supervisor.workers.worker_process, "
            "omnid.supervisor.workers.ray_stage, omnid.stage_entry, omnictl.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('omnid.worker')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
