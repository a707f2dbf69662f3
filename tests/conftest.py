"""Shared fixtures: real daemons in real processes, on real Unix sockets.

`start_daemon(stages=..., pipelines=..., daemon=...)` writes a TOML config,
runs `python -m omnid -c CONFIG` as a subprocess, waits until `/v1/ready`
answers 200 (or the process dies: then the test fails with its log), and
returns a `RunningDaemon`. At teardown every daemon gets SIGTERM, and the
fixture checks that none of its stage workers outlived it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from omnictl.client import ApiError, Client

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
MODELS = Path(os.environ.get("OMNID_TEST_MODELS", ROOT / ".models"))


# ------------------------------------------------------------------------- TOML writing


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (str, Path)):
        return json.dumps(str(v))
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def toml_dumps(data: dict[str, dict[str, Any]]) -> str:
    """Top-level tables of tables ([stages.NAME]) or of values ([daemon])."""
    out: list[str] = []
    for section, body in data.items():
        scalars = {k: v for k, v in body.items() if not isinstance(v, dict) or section == "daemon"}
        tables = {k: v for k, v in body.items() if isinstance(v, dict) and section != "daemon"}
        if scalars:
            out.append(f"[{section}]")
            out += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in scalars.items()]
            out.append("")
        for name, table in tables.items():
            out.append(f"[{section}.{json.dumps(name)}]")
            out += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in table.items()]
            out.append("")
    return "\n".join(out)


def py_stage(function: str, **extra: Any) -> dict[str, Any]:
    """A `python` stage running a function of tests/fixtures/teststages.py."""
    return {"engine": "python", "function": f"teststages:{function}", "python_path": [str(FIXTURES)], **extra}


def sleeper(seconds: float, **extra: Any) -> dict[str, Any]:
    """A python stage that works `seconds` per job (teststages.sleep), cancellable."""
    return py_stage("sleep", defaults={"seconds": seconds}, **extra)


# ------------------------------------------------------------------------- daemons


@dataclass
class RunningDaemon:
    proc: subprocess.Popen[bytes]
    dir: Path
    config_path: Path
    socket: Path
    state_dir: Path
    lock_dir: Path
    log_path: Path
    client: Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = Client(str(self.socket))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stages(self) -> dict[str, dict[str, Any]]:
        return {s["name"]: s for s in self.client.stages()["stages"]}

    def stage_pid(self, name: str) -> int:
        pid = self.stages()[name]["pid"]
        assert pid, f"stage {name} has no pid"
        return pid

    def worker_pids(self) -> list[int]:
        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def submit(self, pipeline: str, inputs: dict[str, Any] | None = None,
               params: dict[str, Any] | None = None, timeout_s: float | None = None) -> str:
        return self.client.submit(pipeline, inputs or {}, params, timeout_s)["id"]

    def wait(self, job: str, timeout: float = 120) -> dict[str, Any]:
        """Follow the job's event stream to its end; return the final job document."""
        deadline = time.monotonic() + timeout
        for ev in self.client.events(job):
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} not finished after {timeout} s")
        return self.client.job(job)

    def events(self, job: str) -> list[dict[str, Any]]:
        return list(self.client.events(job))

    def wait_stage_state(self, stage: str, states: tuple[str, ...], timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            snap = self.stages()[stage]
            if snap["state"] in states:
                return snap
            time.sleep(0.05)
        raise TimeoutError(f"stage {stage} never reached {states}; last: {snap}\n{self.log()[-3000:]}")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def wait_gone(pids: list[int], timeout: float = 10) -> list[int]:
    """Wait until none of `pids` is alive (zombies count as gone); return the survivors."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if alive:
            time.sleep(0.05)
    return alive


TERMINAL = {"succeeded", "failed", "cancelled", "timed_out"}


def wait_for(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.02) -> Any:
    """Poll `cond` until it returns something truthy; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def wait_started(d: RunningDaemon, job: str, stage: str) -> float:
    """Follow the job's events until `stage` starts it; return when that was seen."""
    for ev in d.client.events(job):
        if ev["type"] == "stage_started" and ev["stage"] == stage:
            return time.monotonic()
        if ev["type"] == "state" and ev["state"] in TERMINAL:
            raise AssertionError(f"job {job} ended ({ev}) before stage {stage} started it")
    raise AssertionError(f"the event stream of job {job} ended before stage {stage} started it")


def short_tmpdir() -> Path:
    """A short directory (Unix socket paths are limited to 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="omnid-t-", dir="/tmp"))


def daemon_config(d: Path, stages: dict[str, Any], pipelines: dict[str, Any],
                  daemon: dict[str, Any] | None = None) -> Path:
    cfg = {"daemon": {"socket": str(d / "omnid.sock"), "state_dir": str(d / "state"),
                      "lock_dir": str(d / "lock"), "heartbeat_interval_s": 0.2,
                      "restart_backoff_s": 0.2, "log_level": "debug", **(daemon or {})},
           "stages": stages, "pipelines": pipelines}
    path = d / "omnid.toml"
    path.write_text(toml_dumps(cfg))
    return path


def launch(config_path: Path, log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "omnid", "-c", str(config_path)], stdout=log,
                                stderr=subprocess.STDOUT, env=full_env, cwd=str(config_path.parent))


def wait_ready(d: RunningDaemon, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if d.proc.poll() is not None:
            raise RuntimeError(f"omnid exited with {d.proc.returncode} before it was ready:\n{d.log()[-6000:]}")
        try:
            ok, _ = d.client.ready()
            if ok:
                return
        except (OSError, ApiError, Exception):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"omnid not ready after {timeout} s:\n{d.log()[-6000:]}")


@pytest.fixture
def start_daemon() -> Iterator[Callable[..., RunningDaemon]]:
    started: list[RunningDaemon] = []
    dirs: list[Path] = []

    def start(stages: dict[str, Any], pipelines: dict[str, Any], daemon: dict[str, Any] | None = None,
              *, wait: bool = True, dir: Path | None = None, env: dict[str, str] | None = None) -> RunningDaemon:
        d = dir or short_tmpdir()
        dirs.append(d)
        config_path = daemon_config(d, stages, pipelines, daemon)
        cfg_daemon = {"socket": d / "omnid.sock", "state_dir": d / "state", "lock_dir": d / "lock",
                      **{k: Path(v) for k, v in (daemon or {}).items() if k in ("socket", "state_dir", "lock_dir")}}
        log_path = d / f"omnid-{len(started)}.log"
        proc = launch(config_path, log_path, env)
        rd = RunningDaemon(proc, d, config_path, cfg_daemon["socket"], cfg_daemon["state_dir"],
                           cfg_daemon["lock_dir"], log_path)
        started.append(rd)
        if wait:
            wait_ready(rd)
        return rd

    yield start
    leftovers: list[str] = []
    for rd in started:
        workers = rd.worker_pids()
        rd.stop()
        survivors = wait_gone(workers)
        if survivors:
            leftovers.append(f"{rd.config_path}: workers {survivors} outlived the daemon")
            for p in survivors:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    assert not leftovers, "\n".join(leftovers)
