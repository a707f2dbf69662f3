"""Start-up and shutdown of a real daemon: failed loads, socket ownership, signals.

Each test runs `python -m omnid` as a subprocess (tests/conftest.py). To prove
that no child outlives the daemon, the daemon is started with a unique
environment variable, which every process it spawns inherits; afterwards no
live process on the machine may carry it.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import time
import uuid
from pathlib import Path

import psutil
import pytest
from conftest import RunningDaemon, py_stage, short_tmpdir, wait_gone

TOKEN_VAR = "OMNID_TEST_TOKEN"


def token_env() -> dict[str, str]:
    return {TOKEN_VAR: uuid.uuid4().hex}


def processes_with(env: dict[str, str]) -> list[int]:
    """Live (non-zombie) processes whose environment carries the token."""
    want = env[TOKEN_VAR]
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(TOKEN_VAR) == want:
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def assert_no_process_left(env: dict[str, str], timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while (left := processes_with(env)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left behind: {[psutil.Process(p).cmdline() for p in left if psutil.pid_exists(p)]}"


def spawned_pids(log: str) -> list[int]:
    """Worker pids from the daemon's 'stage worker spawned' lines (console or JSON)."""
    return [int(m) for m in re.findall(r'stage worker spawned.*?(?:\bpid=|"pid": )(\d+)', log)]


def write_module(d: Path, name: str, body: str) -> Path:
    (d / f"{name}.py").write_text(body)
    return d


# ------------------------------------------------------------------------- a stage that cannot load


# As vLLM's engine core fails: a child process prints the real exception (chained), and the
# worker raises one that only points at it.
CHILD_FAILS = '''import subprocess, sys
subprocess.run([sys.executable, "-c", """
try:
    raise ValueError("the real reason: 750 tokens where 512 fit")
except ValueError as e:
    raise RuntimeError("a wrapper of the real reason") from e
"""])
raise RuntimeError("initialization failed. See root cause above.")
'''


@pytest.mark.parametrize("kind", ["raises at import", "missing attribute", "root cause in a child"])
def test_stage_dying_while_loading_stops_the_daemon(kind: str, start_daemon, tmp_path: Path) -> None:
    if kind == "raises at import":
        write_module(tmp_path, "boom_at_import", 'raise RuntimeError("kaboom while importing")\n')
        broken = {"engine": "python", "function": "boom_at_import:run", "python_path": [str(tmp_path)]}
        detail = "RuntimeError: kaboom while importing"
    elif kind == "root cause in a child":
        write_module(tmp_path, "child_fails", CHILD_FAILS)
        broken = {"engine": "python", "function": "child_fails:run", "python_path": [str(tmp_path)]}
        detail = ("RuntimeError: initialization failed. See root cause above. "
                  "(root cause: ValueError: the real reason: 750 tokens where 512 fit)")
    else:
        broken = py_stage("no_such_function")
        detail = "no attribute 'no_such_function'"
    # a healthy stage that loads slowly is still loading when the broken one dies: it must go too
    write_module(tmp_path, "slow_load", "import time\ntime.sleep(1.0)\n\ndef run(i, p, ctx):\n    return {}\n")
    healthy = {"engine": "python", "function": "slow_load:run", "python_path": [str(tmp_path)]}
    env = token_env()
    t0 = time.monotonic()
    d: RunningDaemon = start_daemon({"healthy": healthy, "broken": broken},
                                    {"p": {"stages": ["healthy", "broken"]}}, wait=False, env=env, expect_exit=1)
    code = d.proc.wait(30)
    elapsed = time.monotonic() - t0
    out = d.log()
    assert code == 1, out
    assert elapsed < 15, f"took {elapsed:.1f} s to give up"
    assert "stage 'broken' failed to start" in out, out
    assert "could not load its engine (exit status 3)" in out, out
    assert detail in out, out
    workers = spawned_pids(out)
    assert len(workers) == 2, out
    assert wait_gone(workers, 5) == []
    assert_no_process_left(env)
    assert not d.socket.exists(), "the socket must be removed when the start fails"


def test_stage_exiting_during_load_reports_its_exit_status(start_daemon, tmp_path: Path) -> None:
    write_module(tmp_path, "exit_at_import", "import os\nos._exit(42)\n")
    env = token_env()
    d: RunningDaemon = start_daemon(
        {"quits": {"engine": "python", "function": "exit_at_import:run", "python_path": [str(tmp_path)]}},
        {"p": {"stages": ["quits"]}}, wait=False, env=env, expect_exit=1)
    assert d.proc.wait(30) == 1
    out = d.log()
    assert "stage 'quits' failed to start" in out and "exited with status 42" in out, out
    assert_no_process_left(env)


# ------------------------------------------------------------------------- the socket


def test_second_daemon_on_the_same_socket_refuses(start_daemon) -> None:
    stages, pipes = {"s": py_stage("echo")}, {"p": {"stages": ["s"]}}
    first: RunningDaemon = start_daemon(stages, pipes)
    inode = first.socket.stat().st_ino
    env = token_env()
    second: RunningDaemon = start_daemon(stages, pipes, {"socket": str(first.socket)}, wait=False, env=env,
                                         expect_exit=1)
    assert second.proc.wait(30) == 1
    assert f"another omnid is already listening on {first.socket}" in second.log()
    assert_no_process_left(env)
    # the first daemon's socket is still its own
    assert first.socket.stat().st_ino == inode
    assert first.client.health()["pid"] == first.proc.pid


def test_socket_is_0660_by_default(start_daemon) -> None:
    # The config sets no socket_mode: the daemon's own default applies, whatever the umask.
    d: RunningDaemon = start_daemon({"s": py_stage("echo")}, {"p": {"stages": ["s"]}})
    assert "socket_mode" not in d.config_path.read_text()
    st = os.stat(d.socket)
    assert stat.S_ISSOCK(st.st_mode)
    assert oct(stat.S_IMODE(st.st_mode)) == oct(0o660)


def test_stale_socket_file_is_replaced(start_daemon) -> None:
    d = short_tmpdir()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(d / "omnid.sock"))          # bound, never listening, then gone: a dead daemon's socket
    stale.close()
    rd: RunningDaemon = start_daemon({"s": py_stage("echo")}, {"p": {"stages": ["s"]}}, dir=d)
    assert rd.socket.is_socket()
    assert rd.client.health()["pid"] == rd.proc.pid


def test_a_regular_file_at_the_socket_path_is_not_deleted(start_daemon) -> None:
    d = short_tmpdir()
    precious = d / "omnid.sock"
    precious.write_text("not a socket\n")
    rd: RunningDaemon = start_daemon({"s": py_stage("echo")}, {"p": {"stages": ["s"]}}, dir=d, wait=False,
                                     expect_exit=1)
    assert rd.proc.wait(30) == 1
    assert "is not a socket" in rd.log(), rd.log()
    assert precious.read_text() == "not a socket\n"


# ------------------------------------------------------------------------- signals


def test_sigterm_exits_0_and_removes_the_socket(start_daemon) -> None:
    env = token_env()
    d: RunningDaemon = start_daemon({"a": py_stage("echo"), "b": py_stage("echo")},
                                    {"p": {"stages": ["a", "b"]}}, env=env)
    workers = d.worker_pids()          # the stage workers (and multiprocessing's resource tracker)
    assert {d.stage_pid("a"), d.stage_pid("b")} <= set(workers)
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0, d.log()
    assert not d.socket.exists()
    assert wait_gone(workers, 5) == []
    assert_no_process_left(env)
    assert "stopped" in d.log()


def test_sigint_stops_like_sigterm(start_daemon) -> None:
    d: RunningDaemon = start_daemon({"a": py_stage("echo")}, {"p": {"stages": ["a"]}})
    d.proc.send_signal(signal.SIGINT)
    assert d.proc.wait(30) == 0, d.log()
    assert not d.socket.exists()


def test_sigterm_while_stages_load_exits_0(start_daemon, tmp_path: Path) -> None:
    write_module(tmp_path, "very_slow", "import time\ntime.sleep(30)\n\ndef run(i, p, ctx):\n    return {}\n")
    env = token_env()
    d: RunningDaemon = start_daemon(
        {"slow": {"engine": "python", "function": "very_slow:run", "python_path": [str(tmp_path)]}},
        {"p": {"stages": ["slow"]}}, {"stop_grace_s": 1.0}, wait=False, env=env)
    deadline = time.monotonic() + 30
    while "stage worker spawned" not in d.log():
        assert d.proc.poll() is None and time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(15) == 0, d.log()
    assert not d.socket.exists()
    assert_no_process_left(env)


def test_kill_9_of_the_supervisor_leaves_no_worker(start_daemon) -> None:
    env = token_env()
    d: RunningDaemon = start_daemon({"a": py_stage("echo", devices=[0]), "b": py_stage("sleep")},
                                    {"p": {"stages": ["a", "b"]}}, env=env)
    workers = d.worker_pids()
    assert len(workers) >= 2 and d.stage_pid("a") in workers and d.stage_pid("b") in workers
    # A GPU stage is spawned bare; a CPU stage is forked by the daemon's fork server, its child.
    assert psutil.Process(d.stage_pid("a")).ppid() == d.proc.pid
    server = psutil.Process(d.stage_pid("b")).ppid()
    assert server != d.proc.pid and psutil.Process(server).ppid() == d.proc.pid
    busy = d.submit("p", {"text": "x"}, {"b": {"seconds": 30}})   # one worker is mid-job
    d.wait_stage_state("b", ("busy",), timeout=30)
    assert d.kill9() == -signal.SIGKILL
    assert wait_gone(workers, 5) == [], "workers outlived a SIGKILLed supervisor (PR_SET_PDEATHSIG)"
    assert_no_process_left(env)
    # What it leaves: a stale socket and a released GPU lock. A new daemon in the same place
    # takes both, and the interrupted job is not forgotten.
    assert d.socket.is_socket()
    again: RunningDaemon = start_daemon({"a": py_stage("echo", devices=[0]), "b": py_stage("sleep")},
                                        {"p": {"stages": ["a", "b"]}}, dir=d.dir)
    doc = again.client.job(busy)
    assert doc["state"] == "failed", doc


LOADING_MODULE = '''
import os
import time

STATE = {}

def run(inputs, params, ctx):
    return {"loaded_at": STATE.get("at"), "pid": os.getpid()}

def load(ctx):
    time.sleep(1.5)                     # weights, read as the stage starts
    STATE["at"] = time.time()
    STATE["model"] = ctx.model

run.load = load
'''


def test_ready_means_loaded_unless_a_stage_says_lazy(start_daemon, tmp_path: Path) -> None:
    """A python function's `load` hook runs as its stage starts, before the stage is ready (and
    `omnictl health --wait` waits for it, the daemon's socket not there yet included); a stage
    with `lazy = true` skips it and says so in /v1/ready, `omnictl health` and /v1/stages."""
    import json
    import subprocess
    import sys

    from conftest import ROOT
    write_module(tmp_path, "loadingstage", LOADING_MODULE)
    fn = {"engine": "python", "function": "loadingstage:run", "python_path": [str(tmp_path)]}
    t0 = time.time()
    d: RunningDaemon = start_daemon({"eager": fn, "idle": {**fn, "lazy": True}},
                                    {"eager": {"stages": ["eager"]}, "idle": {"stages": ["idle"]}}, wait=False)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    waited = subprocess.run([sys.executable, "-m", "omnictl", "--socket", str(d.socket), "health", "--wait",
                             "--timeout", "60"], capture_output=True, text=True, timeout=90, env=env, cwd=ROOT)
    assert waited.returncode == 0, waited
    assert waited.stdout.splitlines()[0] == "ready"
    assert "idle   ready  (lazy: loads on its first job)" in waited.stdout, waited.stdout
    ready_body = d.client.ready()[1]
    assert ready_body["lazy"] == ["idle"], ready_body
    stages = {s["name"]: s for s in d.client.stages()["stages"]}
    assert stages["eager"]["lazy"] is False and stages["idle"]["lazy"] is True
    assert stages["eager"]["info"]["loaded"] == ["loadingstage:run.load"], stages["eager"]["info"]
    assert stages["idle"]["info"]["loaded"] == []
    # the eager stage had loaded before it said ready; its first job finds it loaded
    eager = d.submit("eager")
    assert d.wait(eager, timeout=30)["state"] == "succeeded"
    loaded_at = json.loads(d.client.output(eager, "loaded_at")[0])
    assert t0 + 1.5 <= loaded_at <= stages["eager"]["ready_at"], (t0, loaded_at, stages["eager"]["ready_at"])
    # the lazy one's function was given no load call
    idle = d.submit("idle")
    assert d.wait(idle, timeout=30)["state"] == "succeeded"
    assert json.loads(d.client.output(idle, "loaded_at")[0]) is None
